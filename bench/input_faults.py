"""Does a kernel wait for inputs the host wrote? A decode step's small inputs (token ids,
positions, layout arrays) are host-made arrays; on MLX's CUDA backend every array is managed
memory, so a kernel that reads a page the host just wrote may first wait for it to move to the
GPU. Session 11's timelines showed an 8-row gather taking 2 us in some steps and 97-161 us in
others; this measures the gather alone, its indices made four ways:

* `host`: a fresh `mx.array` from a Python list before every evaluation (as a step's inputs);
* `device`: made on the device from the previous evaluation's, `(prev + 1) % vocab`;
* `kept`: one array made once and reused;
* `kept_busy`: `kept`, while the host writes a fresh array of the same size and reads back
  a small device-made one before each evaluation, as a decode-ahead loop's host does beside
  the kernels reading its kept arrays (session 20: its K/V store waited 465 us) — whether
  the host's writes and reads move pages that kept arrays share.

For each, the wall time of `mx.eval` of the gather (an embedding lookup: `rows` ids into a
`[vocab, hidden]` bf16 table), median / p90 / max over `--evals`, and the same evaluated
behind a queued ~1 ms product (`behind`: the gather's time beyond the product's alone; `--product` sets its side), which
is where a step's input arrives in a decode loop. A `host` median well above `kept` and
`device` says the wait is real, and that a step's inputs should be made on the device.
(Session 21's timelines found the wait is not the input's: a kernel that read only its
launch parameters, first in the step, waited 70 us where the gather of host-written ids
had waited 111-144 — docs/PERFORMANCE.md, "Session 21".)

    python bench/input_faults.py [--rows 1,8,64] [--evals 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import harness  # noqa: F401  (puts the repository root on sys.path)
import mlx.core as mx
import numpy as np

MODES = ("host", "device", "kept", "kept_busy")


def stats(xs: list[float]) -> dict[str, float]:
    a = np.array(xs) * 1e6
    return {
        "p50_us": float(np.median(a)),
        "p90_us": float(np.percentile(a, 90)),
        "max_us": float(a.max()),
    }


def measure(rows: int, evals: int, vocab: int, hidden: int, side: int) -> dict[str, object]:
    table = mx.random.normal((vocab, hidden)).astype(mx.bfloat16)
    big = mx.random.normal((side, side)).astype(mx.bfloat16)
    mx.eval(table, big)
    rng = np.random.default_rng(0)
    out: dict[str, object] = {"rows": rows}
    for behind in (False, True):
        base: list[float] = []
        if behind:  # the product alone, to subtract
            for _ in range(evals // 4):
                t = time.perf_counter()
                mx.eval(big @ big)
                base.append(time.perf_counter() - t)
        floor = float(np.median(base)) if base else 0.0
        for how in MODES:
            ids = mx.array(rng.integers(0, vocab, rows).tolist(), dtype=mx.int32)
            echo = ids + 0  # a device-made array of the ids' size, read back by `kept_busy`
            mx.eval(ids, echo)
            times = []
            for i in range(evals + 5):
                if how == "host":
                    ids = mx.array(rng.integers(0, vocab, rows).tolist(), dtype=mx.int32)
                elif how == "device":
                    ids = (ids + 1) % vocab
                elif how == "kept_busy":
                    fresh = mx.array(rng.integers(0, vocab, rows).tolist(), dtype=mx.int32)
                    echo = fresh + 1
                    mx.eval(echo)
                    echo.tolist()
                t = time.perf_counter()
                if behind:
                    mx.eval(big @ big, table[ids])
                else:
                    mx.eval(table[ids])
                if i >= 5:
                    times.append(time.perf_counter() - t - floor)
            out[f"{how}{'_behind' if behind else ''}"] = stats(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,8,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--evals", type=int, default=200)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--product", type=int, default=4096, help="side of the product queued ahead")
    p.add_argument("--json")
    args = p.parse_args()
    results = [measure(r, args.evals, args.vocab, args.hidden, args.product) for r in args.rows]
    print(f"device {mx.default_device()}, {args.evals} evaluations each, wall us of mx.eval")
    print("| rows | indices | alone p50 / p90 / max | behind a product p50 / p90 / max |")
    print("|---|---|---|---|")
    for r in results:
        for how in MODES:
            a, b = r[how], r[f"{how}_behind"]
            assert isinstance(a, dict) and isinstance(b, dict)
            print(
                f"| {r['rows']} | {how} | {a['p50_us']:.1f} / {a['p90_us']:.1f} / {a['max_us']:.0f}"
                f" | {b['p50_us']:.1f} / {b['p90_us']:.1f} / {b['max_us']:.0f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
