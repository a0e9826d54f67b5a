"""engine/spec"""
