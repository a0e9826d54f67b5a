"""When the loop publishes a step (scheduler/publish_order.py): beside the next step's
forward, unless forwards could hide little of publishing; then before the next step."""

from __future__ import annotations

from scheduler.publish_order import PROBE_EVERY, PublishOrder


def overlapping_steps(order: PublishOrder) -> int:
    """Steps published beside the next forward before the order asks for a probe."""
    n = 0
    while not order.publish_first():
        n += 1
    return n


def test_it_overlaps_and_probes_every_so_often() -> None:
    order = PublishOrder()
    assert overlapping_steps(order) == PROBE_EVERY - 1
    order.observe(forward_s=0.010, forward_cpu_s=0.001, publish_s=0.002)  # a device-bound step
    assert not order.first
    overlapping_steps(order)
    order.observe(forward_s=0.0, forward_cpu_s=0.0, publish_s=0.002)  # no forward: snapshots
    assert not order.first
    assert overlapping_steps(order) == PROBE_EVERY - 1


def test_a_forward_that_could_hide_little_of_publishing_has_it_published_first() -> None:
    order = PublishOrder()
    overlapping_steps(order)
    # 1.5 ms forward, 1.4 of it the step thread's own Python: 0.1 ms to hide 5 ms of publishing
    order.observe(forward_s=0.0015, forward_cpu_s=0.0014, publish_s=0.005)
    assert order.first
    assert all(order.publish_first() for _ in range(3 * PROBE_EVERY))


def test_one_slow_forward_does_not_end_publishing_first_and_lasting_ones_do() -> None:
    order = PublishOrder()
    overlapping_steps(order)
    order.observe(forward_s=0.0015, forward_cpu_s=0.0014, publish_s=0.005)
    order.observe(forward_s=0.008, forward_cpu_s=0.001, publish_s=0.005)  # waited for a core
    assert order.first
    for _ in range(20):  # the device now takes longer than publishing
        order.observe(forward_s=0.012, forward_cpu_s=0.001, publish_s=0.005)
    assert not order.first
    assert overlapping_steps(order) == PROBE_EVERY - 1
