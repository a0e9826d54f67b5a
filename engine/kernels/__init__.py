"""Custom kernels for hot spots. Each has a portable twin in plain MLX ops (its reference)."""
