"""The daemon's settings: sources, precedence and the errors a bad value gets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from engine.gguf import QuantizedWeight
from scheduler import prefix_reuse
from transport import cli, cpus
from transport.config import KEYS, PLACEMENTS, ConfigError, DaemonConfig, load
from transport.daemon import build_scheduler, compute_dtype, on_a_gpu_if_auto

EXAMPLE = Path(__file__).parent.parent / "deploy" / "slotserve.toml"


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Path:
    return make_model("tiny")


def no_flags(**given: str) -> dict[str, str | None]:
    return {key.name: given.get(key.name) for key in KEYS}


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(
    model: Path, tmp_path: Path
) -> None:
    file = tmp_path / "s.toml"
    file.write_text(f'model = "{model}"\nslots = 3\ncontext = 512\ndrain_timeout = 7\n')
    env = {"SLOTSERVE_SLOTS": "5", "SLOTSERVE_CONTEXT": "1024"}
    config = load(file, env, no_flags(slots="6"))
    assert (config.slots, config.context, config.drain_timeout) == (6, 1024, 7.0)
    assert config.max_queue == DaemonConfig(model).max_queue


def test_the_example_config_is_valid_and_says_what_it_means(model: Path) -> None:
    config = load(EXAMPLE, {}, no_flags(model=str(model)))
    assert config.endpoints == ("tcp://127.0.0.1:5555", "ipc:///run/slotserve/slotserve.sock")
    assert config.log_file is None and config.pid_file is None and config.memory_budget is None
    assert config.mlx_cache_limit is None  # MLX's own default
    assert config.metrics_host_port == ("127.0.0.1", 9464)
    assert (config.prefix_cache, config.prefix_cache_interval) == (1 << 30, 1024)
    assert config.prefix_cache_placement == "device"
    assert config.decode_ahead == "auto"
    assert config.cpus is None  # wherever the process may run


def test_sizes_lists_and_empty_strings_parse_from_the_environment(model: Path) -> None:
    env = {
        "SLOTSERVE_MODEL": str(model),
        "SLOTSERVE_MEMORY_BUDGET": "1.5GiB",
        "SLOTSERVE_MLX_CACHE_LIMIT": "256 MiB",
        "SLOTSERVE_ENDPOINTS": "tcp://127.0.0.1:1, ipc:///tmp/x",
        "SLOTSERVE_METRICS_ADDRESS": "",
        "SLOTSERVE_SPECULATION": "off",
        "SLOTSERVE_PREFIX_CACHE": "",
        "SLOTSERVE_PREFIX_CACHE_INTERVAL": "0",
        "SLOTSERVE_PREFIX_CACHE_PLACEMENT": "host",
    }
    config = load(None, env, no_flags())
    assert config.memory_budget == 3 << 29 and config.mlx_cache_limit == 256 << 20
    assert config.endpoints == ("tcp://127.0.0.1:1", "ipc:///tmp/x")
    assert config.metrics_host_port is None and config.max_draft == 0
    assert config.prefix_cache is None and config.prefix_cache_interval == 0
    assert config.prefix_cache_placement == "host"


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("slots = 0", "slots: expected an integer >= 1"),
        ('slots = "many"', "slots: expected an integer >= 1"),
        ("drain_timeout = -1", "drain_timeout: expected a number of seconds >= 0"),
        ('log_format = "xml"', "log_format: expected one of plain, json"),
        ('memory_budget = "lots"', "memory_budget: expected bytes"),
        ("prefix_cache_interval = -1", "prefix_cache_interval: expected an integer >= 0"),
        ('prefix_cache_placement = "disk"', "prefix_cache_placement: expected one of device, host"),
        ('endpoints = ["http://x"]', "endpoints: expected tcp://host:port or ipc://path"),
        ('metrics_address = "9464"', 'metrics_address: expected "host:port"'),
        ("slot = 4", "slot: unknown key"),
        ("slots = [", ".*: not valid TOML"),
        ('cpus = "0-"', 'cpus: expected a CPU list like "0-7"'),
        ('cpus = "3-1"', "cpus: the range '3-1' runs backwards"),
        ('cpus = "0,100000"', "cpus: CPUs 100000 are not available to this process"),
    ],
)
def test_a_bad_value_is_refused_naming_the_key_and_the_file(
    model: Path, tmp_path: Path, toml: str, message: str
) -> None:
    file = tmp_path / "bad.toml"
    file.write_text(toml + "\n")
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[")) as e:
        load(file, {}, no_flags(model=str(model)))
    assert str(file) in str(e.value)


def test_cpus_parse_as_taskset_lists_them(model: Path) -> None:
    env = {"SLOTSERVE_CPUS": f"{min(cpus.allowed())}"}
    assert load(None, env, no_flags(model=str(model))).cpus == {min(cpus.allowed())}
    assert cpus.parse(" 0-2, 5 ,7-8") == {0, 1, 2, 5, 7, 8}
    assert cpus.format_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpus.parse("") is None


def test_a_bad_environment_value_names_the_variable(model: Path) -> None:
    env = {"SLOTSERVE_DRAIN_TIMEOUT": "soon"}
    with pytest.raises(ConfigError, match="environment SLOTSERVE_DRAIN_TIMEOUT"):
        load(None, env, no_flags(model=str(model)))


def test_serve_without_a_model_exits_2_saying_how_to_set_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLOTSERVE_MODEL", raising=False)
    assert cli.main(["serve"]) == 2
    assert "model: required" in capsys.readouterr().err


def test_serve_with_a_missing_model_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--model", str(tmp_path / "none.gguf")]) == 2
    assert "model: no such file" in capsys.readouterr().err


def test_check_validates_the_settings_and_exits_0_without_serving(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--config", str(EXAMPLE), "--model", str(model), "--check"]) == 0
    assert "settings are valid" in capsys.readouterr().err


def test_a_drafter_for_the_model_is_accepted_and_empty_means_none(
    model: Path, make_dflash: Callable[..., Path]
) -> None:
    drafter = make_dflash("tiny")
    assert load(None, {}, no_flags(model=str(model), dflash=str(drafter))).dflash == drafter
    assert load(None, {"SLOTSERVE_DFLASH": ""}, no_flags(model=str(model))).dflash is None


def serve_check(model: Path, *extra: str) -> list[str]:
    return ["serve", "--model", str(model), "--metrics-address", "", *extra, "--check"]


def test_serve_check_refuses_a_missing_drafter_file(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(serve_check(model, "--dflash", str(tmp_path / "none.gguf"))) == 2
    err = capsys.readouterr().err
    assert "config error: dflash: no such file" in err and "flag --dflash" in err


def test_serve_check_refuses_a_file_that_is_not_a_drafter(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(serve_check(model, "--dflash", str(model))) == 2
    assert "dflash: " in (err := capsys.readouterr().err)
    assert "architecture 'qwen35' is not a DFlash drafter" in err


def test_serve_check_refuses_a_drafter_made_for_another_target(
    model: Path, make_dflash: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    other = make_dflash("tiny", n_embd=32, n_vocab=256, mask_token_id=200)
    assert cli.main(serve_check(model, "--dflash", str(other))) == 2
    err = capsys.readouterr().err
    assert f"config error: dflash: {other}: drafter does not fit target {model}" in err
    assert "hidden size 32 != the target's 64" in err and "vocabulary of 256" in err


def test_a_drafter_with_speculation_off_is_refused(
    model: Path, make_dflash: Callable[..., Path]
) -> None:
    env = {"SLOTSERVE_SPECULATION": "off", "SLOTSERVE_DFLASH": str(make_dflash("tiny"))}
    with pytest.raises(ConfigError, match=r"^dflash: a drafter needs speculation = auto") as e:
        load(None, env, no_flags(model=str(model)))
    assert "environment SLOTSERVE_SPECULATION" in str(e.value)


def test_weights_are_stored_or_dense(model: Path) -> None:
    assert load(None, {}, no_flags(model=str(model))).weights == "stored"
    assert load(None, {"SLOTSERVE_WEIGHTS": "dense"}, no_flags(model=str(model))).weights == "dense"
    with pytest.raises(ConfigError, match=r"weights.*expected one of stored, dense"):
        load(None, {}, no_flags(model=str(model), weights="f16"))


def test_dtype_and_compile_settings_reach_the_model_and_runner(model: Path) -> None:
    """`dtype` and `compile` are checked like every key and take effect in the scheduler the
    daemon builds: the model's weights in that dtype, the pool's K/V beside it, compiled
    steps when asked."""
    default = load(None, {}, no_flags(model=str(model)))
    assert (default.dtype, default.compile) == ("auto", "auto")
    for bad in ({"dtype": "f8"}, {"compile": "yes"}):
        with pytest.raises(ConfigError, match=rf"{next(iter(bad))}.*expected one of"):
            load(None, {}, no_flags(model=str(model), **bad))
    assert compute_dtype("float16") == mx.float16
    assert (on_a_gpu_if_auto("on"), on_a_gpu_if_auto("off")) == (True, False)
    try:  # "auto" follows the default device
        mx.set_default_device(mx.cpu)
        assert (compute_dtype("auto"), on_a_gpu_if_auto("auto")) == (mx.float32, False)
        if mx.cuda.is_available() or mx.metal.is_available():
            mx.set_default_device(mx.gpu)
            assert (compute_dtype("auto"), on_a_gpu_if_auto("auto")) == (mx.bfloat16, True)
    finally:
        mx.set_default_device(
            mx.gpu if mx.cuda.is_available() or mx.metal.is_available() else mx.cpu
        )
    env = {"SLOTSERVE_DTYPE": "bfloat16", "SLOTSERVE_COMPILE": "on", "SLOTSERVE_PREFIX_CACHE": ""}
    config = load(None, env, no_flags(model=str(model), slots="2", context="64"))
    scheduler, _ = build_scheduler(config)
    runner = scheduler.runner
    assert runner.compile and runner.pool.kv_dtype == mx.bfloat16
    assert runner.model.dtype == mx.bfloat16


def test_the_mlx_cache_limit_is_set_before_the_model_loads(model: Path) -> None:
    """`mlx_cache_limit`: MLX keeps at most that many bytes of freed buffers; unset, MLX's
    own default stands."""
    default = mx.set_cache_limit(0)  # (returns the limit it replaces)
    mx.set_cache_limit(default)
    try:
        env = {"SLOTSERVE_MLX_CACHE_LIMIT": "64MiB", "SLOTSERVE_PREFIX_CACHE": ""}
        build_scheduler(load(None, env, no_flags(model=str(model), slots="1", context="32")))
        assert mx.set_cache_limit(default) == 64 << 20
        build_scheduler(load(None, {}, no_flags(model=str(model), slots="1", context="32")))
        assert mx.set_cache_limit(default) == default
    finally:
        mx.set_cache_limit(default)
    with pytest.raises(ConfigError, match="mlx_cache_limit: expected bytes"):
        load(None, {"SLOTSERVE_MLX_CACHE_LIMIT": "most"}, no_flags(model=str(model)))


def test_decode_ahead_reaches_the_scheduler_and_is_checked(
    model: Path, make_dflash: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """`decode_ahead`: "auto" by default, on where MLX computes on a GPU; "on" reaches the
    scheduler with speculation off or on (beside the n-gram and MTP drafters); beside a
    DFlash drafter, conditioned on trunk layers a queued step does not return, it is off,
    and "on" says so; anything else is refused naming the key."""
    with pytest.raises(ConfigError, match=r"decode_ahead.*expected one of auto, off, on"):
        load(None, {"SLOTSERVE_DECODE_AHEAD": "yes"}, no_flags(model=str(model)))
    gpu = mx.default_device() == mx.gpu
    drafter = str(make_dflash("tiny"))
    for value, speculation, dflash, on in (
        ("off", "off", "", False),
        ("on", "off", "", True),
        ("on", "auto", "", True),
        ("auto", "off", "", gpu),
        ("auto", "auto", "", gpu),
        ("on", "auto", drafter, False),
        ("auto", "auto", drafter, False),
    ):
        env = {"SLOTSERVE_DECODE_AHEAD": value, "SLOTSERVE_SPECULATION": speculation}
        env |= {"SLOTSERVE_PREFIX_CACHE": "", "SLOTSERVE_DFLASH": dflash}
        caplog.clear()
        scheduler, _ = build_scheduler(load(None, env, no_flags(model=str(model), slots="1")))
        assert scheduler.decode_ahead is on
        warned = any("decode_ahead is on but" in r.getMessage() for r in caplog.records)
        assert warned is (value == "on" and not on)


def test_dense_weights_are_dequantized_at_load_and_stored_ones_are_not(
    make_model: Callable[..., Path],
) -> None:
    """`weights`: the model the daemon builds holds a q8_0 file's matrices quantized
    (`stored`) or as floats (`dense`)."""
    q8 = make_model("tiny", quant="q8_0")
    built = {}
    for weights in ("stored", "dense"):
        env = {"SLOTSERVE_WEIGHTS": weights, "SLOTSERVE_PREFIX_CACHE": ""}
        scheduler, _ = build_scheduler(load(None, env, no_flags(model=str(q8), slots="1")))
        built[weights] = scheduler.runner.model.tok_embd
    assert isinstance(built["stored"], QuantizedWeight)
    assert isinstance(built["dense"], mx.array)


def test_prefix_cache_placement_reaches_the_scheduler_and_is_logged(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`prefix_cache_placement`: "device" by default (snapshots stay where MLX computes),
    "host" moves them to host memory at the end of their step; the start log says where,
    how much and what one snapshot takes."""
    assert PLACEMENTS == prefix_reuse.PLACEMENTS  # (the config's copy, kept free of MLX)
    for placement in PLACEMENTS:
        caplog.clear()
        env = {"SLOTSERVE_PREFIX_CACHE_PLACEMENT": placement, "SLOTSERVE_PREFIX_CACHE": "64MiB"}
        config = load(None, env, no_flags(model=str(model), slots="1", context="64"))
        with caplog.at_level("INFO"):
            scheduler, _ = build_scheduler(config)
        assert scheduler.config.prefix_cache is not None
        assert scheduler.config.prefix_cache.placement == placement
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefix")]
        assert lines == [
            f"prefix cache: 64 MiB of {placement} memory; a snapshot of 64 tokens takes "
            f"{scheduler.runner.pool.bytes_for(64) / 2**20:.1f} MiB"
        ]


def test_precompile_compiles_every_decode_shape_before_serving_and_is_checked(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`precompile`: "auto" by default (on where MLX computes on a GPU); "on" with compile
    on compiles every decode width x past bucket of the pool on the scheduler's step thread
    (2 slots x 130 positions: 2 x 4), after which a request decodes without compiling;
    "all" adds speculation's verify shapes; with compile off, "on" says there is nothing to
    compile; anything else is refused."""
    import anyio

    from scheduler import Request
    from transport.daemon import precompile

    with pytest.raises(ConfigError, match=r"precompile.*expected one of auto, off, on"):
        load(None, {"SLOTSERVE_PRECOMPILE": "yes"}, no_flags(model=str(model)))
    assert load(None, {}, no_flags(model=str(model))).precompile == "auto"
    flags = no_flags(model=str(model), slots="2", context="130")

    async def serve(env: dict[str, str]) -> tuple[int, int]:
        config = load(
            None, {"SLOTSERVE_PREFIX_CACHE": "", "SLOTSERVE_SPECULATION": "off", **env}, flags
        )
        scheduler, _ = build_scheduler(config)
        async with scheduler.running():
            made = await precompile(scheduler, config.precompile)
            cold = scheduler.runner.cold_steps
            request = Request(prompt=[1, 2, 3], max_tokens=8, ignore_eos=True, request_id="a")
            await scheduler.submit(request).collect()
            return made, scheduler.runner.cold_steps - cold

    made, cold = anyio.run(serve, {"SLOTSERVE_PRECOMPILE": "on", "SLOTSERVE_COMPILE": "on"})
    assert made == 2 * 4 and cold == 1  # the prompt's prefill shape only
    # "all" with speculation: also verify steps of 1..draft_depth drafts a row, 2 widths x
    # the 3 past buckets rows of 2..5 tokens can start in (0, 64, 128)
    every = {"SLOTSERVE_PRECOMPILE": "all", "SLOTSERVE_COMPILE": "on"}
    made, _ = anyio.run(
        serve, every | {"SLOTSERVE_SPECULATION": "auto", "SLOTSERVE_DRAFT_DEPTH": "4"}
    )
    assert made == 2 * 4 + 4 * 2 * 3
    assert anyio.run(serve, every)[0] == 2 * 4  # speculation off: decode shapes only
    assert anyio.run(serve, {"SLOTSERVE_PRECOMPILE": "off", "SLOTSERVE_COMPILE": "on"})[0] == 0
    caplog.clear()
    assert anyio.run(serve, {"SLOTSERVE_PRECOMPILE": "on", "SLOTSERVE_COMPILE": "off"})[0] == 0
    assert any("precompile is on but compile is off" in r.getMessage() for r in caplog.records)


def test_serve_check_refuses_bad_engine_switches_naming_each(
    model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels read their switches when they first launch, on a GPU: a bad value would
    fail every step there after the daemon had started. `serve` checks them all first."""
    monkeypatch.setenv("SLOTSERVE_GEMV_MMA", "yes")
    monkeypatch.setenv("SLOTSERVE_GDN_WARPS", "32")
    monkeypatch.setenv("SLOTSERVE_FUSED_ATTENTION", "off")
    assert cli.main(serve_check(model)) == 2
    err = capsys.readouterr().err
    assert "config error: SLOTSERVE_GEMV_MMA='yes': one of 1, 0" in err
    assert "SLOTSERVE_GDN_WARPS='32': warps a block are 1, 2, 4, 8 or 16" in err
    assert "SLOTSERVE_FUSED_ATTENTION='off': one of 1, 0" in err


def test_serve_check_warns_of_a_switch_nothing_reads(
    model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_GEMV_MAM", "0")  # misspelt: ignored, but said so
    monkeypatch.setenv("SLOTSERVE_GEMV_MMA", "0")
    monkeypatch.setenv("SLOTSERVE_SLOTS", "4")  # a setting, not a switch
    assert cli.main(serve_check(model)) == 0
    err = capsys.readouterr().err
    assert "warning: SLOTSERVE_GEMV_MAM is set but nothing reads it" in err
    assert "SLOTSERVE_SLOTS is set" not in err and "SLOTSERVE_GEMV_MMA is set" not in err
