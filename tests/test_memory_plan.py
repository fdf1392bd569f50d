"""Device memory planning (kvtier/memory_plan.py): the arithmetic with stated device sizes, the
refusal messages, checkpoint weight sizes from safetensors headers; no GPU needed. The last test
reads a real device and skips on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.cachesvc.__main__ import device_pool_plan
from kvtier.cachesvc.config import parse_config
from kvtier.memory_plan import (
    GIB,
    MIB,
    RUNTIME_OVERHEAD_BYTES,
    MemoryPlanError,
    Reserve,
    WeightSize,
    check_replica_fits,
    checkpoint_weight_bytes,
    config_param_count,
    estimate_activation_reserve,
    model_needs,
    plan_device_pool,
    safetensors_tensors,
)
from kvtier.model_spec import TINY_LLAMA_CONFIG

W2 = WeightSize(2 * GIB, 1 << 30, "stated")
R1 = Reserve(1 * GIB, "stated")


def plan(total_gib=80, free_gib=79, fraction=0.9, replicas=2, block=1 * MIB, weights=W2, reserve=R1):
    return plan_device_pool(
        device="cuda:0 (test)",
        total_bytes=int(total_gib * GIB),
        free_bytes=int(free_gib * GIB),
        memory_fraction=fraction,
        block_bytes=block,
        num_replicas=replicas,
        weights=weights,
        reserve=reserve,
    )


def test_pool_is_the_total_budget_minus_others_minus_the_replicas():
    p = plan()
    # 0.9 x 80 = 72 GiB; 1 GiB in use by others; 2 x (2 + 1) GiB for the replicas.
    assert p.budget_bytes == int(0.9 * 80 * GIB)
    assert p.used_by_others == 1 * GIB
    assert p.replicas_bytes == 6 * GIB
    assert p.pool_bytes == p.budget_bytes - 7 * GIB
    assert p.num_blocks == p.pool_bytes // MIB
    # The pool never takes memory that is not free: it leaves the replicas and (1 - f) x total.
    assert p.pool_bytes + p.replicas_bytes <= p.free_bytes - int(0.1 * 80 * GIB) + 1


def test_fraction_is_of_total_memory_not_of_free():
    busy = plan(free_gib=70)  # others hold 10 GiB
    idle = plan(free_gib=80)
    assert idle.pool_bytes - busy.pool_bytes == 10 * GIB
    assert plan(fraction=0.5).pool_bytes == 40 * GIB - 1 * GIB - 6 * GIB


def test_more_replicas_take_their_weights_and_reserve_out_of_the_pool():
    assert plan(replicas=0).pool_bytes - plan(replicas=3).pool_bytes == 3 * (2 * GIB + 1 * GIB)


def test_the_logged_block_shows_every_term_of_the_arithmetic():
    text = plan().describe()
    lines = text.splitlines()
    assert lines[0] == "device memory plan for cuda:0 (test):"
    assert "80.00 GiB" in lines[1]
    assert "--memory-fraction 0.9" in lines[2] and "72.00 GiB" in lines[2]
    assert "1.00 GiB" in lines[3] and "free 79.00 GiB" in lines[3]
    assert "2 compute replica(s) x 3.00 GiB" in lines[4] and "6.00 GiB" in lines[4]
    assert "weights" in lines[5] and "2.00 GiB" in lines[5] and "stated" in lines[5]
    assert "activation reserve" in lines[6] and "1.00 GiB" in lines[6]
    assert (
        "KV pool" in lines[7] and "65.00 GiB" in lines[7] and f"{65 * 1024} blocks x {MIB} bytes" in lines[7]
    )


def test_a_budget_too_small_for_one_block_is_a_clear_error():
    assert plan(total_gib=8, free_gib=7.5).num_blocks == int(0.7 * 1024)  # 7.2 - 0.5 - 6 = 0.7 GiB
    with pytest.raises(MemoryPlanError, match="leaves 0.00 GiB for the KV pool, less than one block"):
        plan(total_gib=8, free_gib=8, fraction=0.75)  # 6 - 0 - 6 = 0


def test_others_holding_the_budget_leave_no_pool_and_say_so():
    # 0.9 x 16 = 14.4 GiB budget; others hold 10; two replicas need 6: -1.6 GiB.
    with pytest.raises(MemoryPlanError) as e:
        plan(total_gib=16, free_gib=6)
    msg = str(e.value)
    assert "leaves -1.60 GiB for the KV pool, less than one block (1048576 bytes)" in msg
    assert "--memory-fraction" in msg and "--compute-replicas" in msg and "--num-blocks" in msg
    assert "device memory plan for cuda:0 (test):" in msg  # the arithmetic comes with the error
    # A pool of a few bytes short of one block is refused too.
    with pytest.raises(MemoryPlanError, match="less than one block"):
        plan(total_gib=1, free_gib=1, fraction=1.0, replicas=0, block=2 * GIB)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01])
def test_fraction_out_of_range_is_refused(fraction):
    with pytest.raises(MemoryPlanError, match=r"--memory-fraction must be in \(0, 1\]"):
        plan(fraction=fraction)


def test_inconsistent_device_figures_are_refused():
    with pytest.raises(MemoryPlanError, match="not 0 <= free <= total"):
        plan(total_gib=10, free_gib=11)
    with pytest.raises(MemoryPlanError, match="--compute-replicas must be >= 0"):
        plan(replicas=-1)


def test_replica_refuses_with_the_numbers_when_free_memory_is_short():
    with pytest.raises(MemoryPlanError) as e:
        check_replica_fits(
            device="cuda:0 (test)", total_bytes=80 * GIB, free_bytes=int(2.5 * GIB), weights=W2, reserve=R1
        )
    msg = str(e.value)
    assert "not enough free device memory to load the model on cuda:0 (test)" in msg
    assert "2.50 GiB free of 80.00 GiB" in msg
    assert "needs 3.00 GiB = weights 2.00 GiB (stated) + activation reserve 1.00 GiB (stated)" in msg
    assert "short by 0.50 GiB" in msg
    assert "--memory-fraction" in msg and "--compute-replicas" in msg


def test_replica_that_fits_gets_the_figures_for_its_log():
    line = check_replica_fits(
        device="cuda:0 (test)", total_bytes=80 * GIB, free_bytes=3 * GIB, weights=W2, reserve=R1
    )
    assert line.startswith("cuda:0 (test): 3.00 GiB free of 80.00 GiB; this replica needs 3.00 GiB")


def test_weights_from_safetensors_headers_match_the_model(tiny_model_dir):
    from kvtier.computesvc.model import build_tiny_model

    model = build_tiny_model(seed=0)
    params = sum(p.numel() for p in model.parameters())
    assert config_param_count({"model_type": "llama", **TINY_LLAMA_CONFIG}) == params
    stored = checkpoint_weight_bytes(tiny_model_dir)
    assert (stored.num_params, stored.num_bytes) == (params, 4 * params)  # saved as float32
    as_bf16 = checkpoint_weight_bytes(tiny_model_dir, "bfloat16")
    assert as_bf16.num_bytes == 2 * params and "safetensors headers of 1 file(s)" in as_bf16.source
    tensors = safetensors_tensors(next(tiny_model_dir.glob("*.safetensors")))
    assert tensors["model.embed_tokens.weight"] == ("F32", [258, 64])


def test_weights_fall_back_to_file_sizes_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 12345)
    w = checkpoint_weight_bytes(tmp_path, "float16")
    assert (w.num_bytes, w.num_params) == (12345, None) and "*.bin" in w.source
    with pytest.raises(ValueError, match="no \\*.safetensors or \\*.bin"):
        checkpoint_weight_bytes(tmp_path / "missing")


def test_a_broken_safetensors_header_is_named(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((5).to_bytes(8, "little") + b"nope!")
    with pytest.raises(ValueError, match="model.safetensors: safetensors header is not JSON"):
        safetensors_tensors(bad)


def test_activation_estimate_grows_with_the_forward_and_can_be_overridden(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    small = estimate_activation_reserve(config, "float32", max_num_batched_tokens=16, max_num_seqs=1)
    big = estimate_activation_reserve(config, "float32", max_num_batched_tokens=4096, max_num_seqs=64)
    assert RUNTIME_OVERHEAD_BYTES < small.num_bytes < big.num_bytes
    assert "--activation-reserve-gib overrides" in big.source
    # A 1B Llama (TinyLlama's shape) in bfloat16 at the compute defaults: under 2 GiB all in.
    one_b = {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_hidden_layers": 22,
        "vocab_size": 32000,
    }
    assert estimate_activation_reserve(one_b, "bfloat16").num_bytes < 2 * GIB
    assert 1.0e9 < config_param_count(one_b) < 1.2e9
    weights, reserve = model_needs(tiny_model_dir, "float32", reserve_bytes=3 * MIB)
    assert reserve == Reserve(3 * MIB, "given (--activation-reserve-gib)")
    assert weights.num_bytes == checkpoint_weight_bytes(tiny_model_dir, "float32").num_bytes


def test_cache_service_plans_from_its_flags(tiny_model_dir):
    cfg = parse_config(
        ["--model", str(tiny_model_dir), "--compute-replicas", "3", "--activation-reserve-gib", "0.5"]
    )
    p = device_pool_plan(cfg, "bfloat16", 4096, "cuda:0 (test)", total=16 * GIB, free=15 * GIB)
    weights = checkpoint_weight_bytes(tiny_model_dir, "bfloat16").num_bytes
    assert p.pool_bytes == int(0.9 * 16 * GIB) - GIB - 3 * (weights + GIB // 2)
    assert p.num_blocks == p.pool_bytes // 4096
    # Without --model the built-in model's size is counted from its config.
    tiny = device_pool_plan(parse_config([]), "float32", 4096, "cuda:0 (test)", total=16 * GIB, free=16 * GIB)
    assert tiny.num_replicas == 2 and tiny.weights.num_params == config_param_count(
        {"model_type": "llama", **TINY_LLAMA_CONFIG}
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory-fraction", "1.5"], "--memory-fraction must be in (0, 1]"),
        (["--compute-replicas", "-1"], "--compute-replicas must be >= 0"),
        (["--activation-reserve-gib", "-2"], "--activation-reserve-gib must be >= 0"),
    ],
)
def test_cache_service_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert message in capsys.readouterr().err


def test_replica_refuses_before_loading_weights(monkeypatch, tiny_model_dir):
    from kvtier.computesvc import model as model_mod

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (10 * MIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the memory check")

    monkeypatch.setattr(model_mod.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(MemoryPlanError) as e:
        model_mod.load_model(tiny_model_dir, device="cuda")
    msg = str(e.value)
    assert "cuda:0 (Fake GPU): 0.01 GiB free of 80.00 GiB" in msg and "short by" in msg
    with pytest.raises(MemoryPlanError, match="activation reserve 1.00 GiB"):
        model_mod.load_model(None, device="cuda:0", activation_reserve_bytes=GIB)


def test_real_device_plan_and_replica_check():
    if not torch.cuda.is_available():
        pytest.skip(
            "no CUDA device: the real free-memory check runs on the GPU machine (scripts/gpu_evidence.sh)"
        )
    from kvtier.computesvc.model import check_device_memory

    free, total = torch.cuda.mem_get_info(0)
    p = device_pool_plan(parse_config([]), "bfloat16", 1 << 20, "cuda:0", total=total, free=free)
    print(p.describe())
    assert p.num_blocks > 0
    check_device_memory(None, "float32", "cuda")  # the tiny model fits on any GPU


def _fake_device(monkeypatch, free: int, total: int) -> None:
    import kvtier.cachesvc.__main__ as cache_main

    monkeypatch.setattr(cache_main, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")


def test_plan_pool_on_cuda_sizes_the_pool_and_logs_the_block(monkeypatch, caplog, tiny_model_dir):
    from kvtier.cachesvc.__main__ import model_shape, plan_pool

    _fake_device(monkeypatch, free=15 * GIB, total=16 * GIB)
    cfg = parse_config(["--backend", "cuda", "--model", str(tiny_model_dir), "--activation-reserve-gib", "1"])
    with caplog.at_level("INFO", logger="kvtier.cache"):
        plan = plan_pool(cfg, model_shape(cfg))
    block_bytes = model_shape(cfg).block_bytes(16, "float32")
    weights = checkpoint_weight_bytes(tiny_model_dir, "float32").num_bytes
    assert plan.num_blocks == (int(0.9 * 16 * GIB) - GIB - 2 * (weights + GIB)) // block_bytes
    assert "device memory plan for cuda:0 (Fake GPU):" in caplog.text and "= KV pool" in caplog.text


def test_cache_service_refuses_to_start_when_the_plan_leaves_no_pool(monkeypatch, caplog):
    from kvtier.cachesvc.__main__ import main

    _fake_device(monkeypatch, free=2 * GIB, total=4 * GIB)
    argv = ["--backend", "cuda", "--activation-reserve-gib", "1", "--listen", "unix:///nonexistent/x.sock"]
    with caplog.at_level("ERROR", logger="kvtier.cache"):
        assert main(argv) == 2
    assert (
        "cannot start: the device memory budget leaves" in caplog.text
        and "less than one block" in caplog.text
    )


# ------------------------------------------------------------ the compute side and `kvtier up`


def test_kvtier_up_tells_the_cache_service_how_many_replicas_share_its_device():
    from kvtier.cli.cli import _service_args, build_parser
    from kvtier.cpu_plan import gpu_present, plan_cpu, plan_for_flags

    chosen = plan_cpu(device="cuda" if gpu_present() else "cpu").replicas  # `kvtier up`'s own choice
    for argv, replicas in (
        (["up"], chosen),
        (["up", "--replicas", "3"], 3),
        (["up", "--nodes", "2", "--replicas", "1"], 1),
    ):
        args = build_parser().parse_args(argv)
        plan_for_flags(args)  # as cmd_up does: --replicas / --threads left out are chosen first
        cache_args, _, _ = _service_args(args)
        assert parse_config(cache_args).compute_replicas == replicas, argv


def test_a_replica_passes_its_activation_reserve_to_the_pre_load_check(monkeypatch, tmp_path):
    """In process, against a real cache service: the replica's --activation-reserve-gib reaches
    load_model (on cuda, check_device_memory; the refusal itself is tested above)."""
    import asyncio

    from servers import TOKEN, cache_service

    from kvtier.computesvc import replica as replica_mod
    from kvtier.computesvc.config import parse_config as compute_config

    assert compute_config([]).activation_reserve_bytes() is None  # estimated from the shape
    with pytest.raises(SystemExit, match="--activation-reserve-gib must be >= 0"):
        compute_config(["--activation-reserve-gib", "-1"])
    seen = []
    real_load = replica_mod.load_model
    monkeypatch.setattr(
        replica_mod,
        "load_model",
        lambda *a, **k: seen.append(k["activation_reserve_bytes"]) or real_load(*a, **k),
    )
    with cache_service(tmp_path, "--num-blocks", "16") as svc:
        cfg = compute_config(["--cache", svc.address, "--activation-reserve-gib", "0.75"])

        async def start_and_stop():
            r = replica_mod.Replica(cfg, TOKEN)
            await r.start()
            await r.stop()

        asyncio.run(start_and_stop())
    assert seen == [int(0.75 * GIB)]
