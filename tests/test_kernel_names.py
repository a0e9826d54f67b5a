"""Our CUDA kernels' names, which MLX also uses as the key of its on-disk cache of compiled
kernels (shared by every process of a machine, and by every version of this code): a name
must change with anything that changes the kernel's code, and stay the same across processes.
Runs on any machine: naming needs no GPU."""

from __future__ import annotations

import re
import subprocess
import sys

from engine.kernels import gdn_mixer_cuda
from engine.kernels.cuda import kernel_name

INPUTS = ["proj", "pad_index", "row_lengths", "conv_state", "state"]
OUTPUTS = ["y", "state_out", "conv_out"]


def test_a_kernel_is_named_the_same_in_every_process() -> None:
    source = gdn_mixer_cuda._source(1e-6, capture=False)
    here = kernel_name("gdn_mixer", INPUTS, OUTPUTS, source)
    code = (
        "from engine.kernels import gdn_mixer_cuda; from engine.kernels.cuda import kernel_name;"
        f"print(kernel_name('gdn_mixer', {INPUTS!r}, {OUTPUTS!r},"
        " gdn_mixer_cuda._source(1e-6, capture=False)))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert there == here
    assert re.fullmatch(r"slotserve_gdn_mixer_[0-9a-f]{16}", here)


def test_anything_that_changes_the_code_changes_the_name() -> None:
    """Another eps baked in, the capture variant (more parameters), other inputs or outputs:
    each is other code, so another name — whatever order a process makes them in."""
    base = kernel_name("gdn_mixer", INPUTS, OUTPUTS, gdn_mixer_cuda._source(1e-6, False))
    others = {
        kernel_name("gdn_mixer", INPUTS, OUTPUTS, gdn_mixer_cuda._source(1e-5, False)),
        kernel_name(
            "gdn_mixer",
            [*INPUTS, "cap_index"],
            [*OUTPUTS, "cap_states", "cap_window"],
            gdn_mixer_cuda._source(1e-6, True),
        ),
        kernel_name("gdn_mixer", INPUTS[:-1], OUTPUTS, gdn_mixer_cuda._source(1e-6, False)),
        kernel_name("gdn_mixer", INPUTS, OUTPUTS[:-1], gdn_mixer_cuda._source(1e-6, False)),
        kernel_name("gdn_mixer", INPUTS, OUTPUTS, gdn_mixer_cuda._source(1e-6, False) + " "),
    }
    assert base not in others and len(others) == 5
