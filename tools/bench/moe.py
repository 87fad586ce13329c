"""Section 9: Mixtral-shaped MoE layers at TP2 x EP2 against dense, their all-to-all bytes against the formula, and
Mixtral-8x7B's bytes per rank at tp=8 x ep=8 on the meta device (docs/performance.md, section 9)."""

from __future__ import annotations

from typing import Any, Dict
from unittest import mock

from .common import Pool, alternate, hf_model, log, median, section, table, timed

FULL = dict(hidden=256, intermediate=896, experts=8, top_k=2, layers=4, batch=4, seq=64, rounds=5)
QUICK = dict(hidden=64, intermediate=96, experts=8, top_k=2, layers=2, batch=2, seq=16, rounds=2)
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
TP, EP, BYTES_GOAL_PERCENT = 8, 8, 2.0
_STATE: Dict[str, Any] = {}


def case_setup(spec: Dict[str, int], tp: int, ep: int) -> None:
    import torch

    from nxdtp import parallel_state as ps
    from nxdtp.modules.moe import ExpertMLPs, MoE, RouterTopK

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    h, e, k = spec["hidden"], spec["experts"], spec["top_k"]
    torch.manual_seed(0)
    _STATE["layers"] = torch.nn.ModuleList(
        MoE(RouterTopK(e, k, h), ExpertMLPs(e, k, h, spec["intermediate"], "silu", glu_mlp=True, capacity_factor=None,
                                            normalize_top_k_affinities=True)) for _ in range(spec["layers"]))
    # Each rank its micro-batch of the global batch; one process alone takes all of it.
    rows = spec["batch"] * 4 // ps.get_data_parallel_size()
    _STATE["x"] = torch.randn(rows, spec["seq"], h)


def case_step(count_all_to_all: bool = False) -> Dict[str, float]:
    from nxdtp import comm, grads

    sent, original = [], comm.all_to_all

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    def step():
        x = _STATE["x"]
        for layer in _STATE["layers"]:
            x = x + layer(x)[0]
        x.square().mean().backward()
        grads.allreduce_gradients(_STATE["layers"])

    with mock.patch.object(comm, "all_to_all", counting if count_all_to_all else original):
        return {"seconds": timed(step), "all_to_all_bytes": float(sum(sent))}


def case_mixtral_bytes(rank: int) -> Dict[str, float]:
    from nxdtp.models import parallelize_model
    from nxdtp.parallel_state import simulated_topology
    from nxdtp.storage import held_bytes

    model = hf_model(MIXTRAL_8X7B, "mixtral", device="meta")
    dense = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    experts = sum(b for n, b in dense.items() if ".experts." in n)
    with simulated_topology(world_size=TP * EP, rank=rank, tensor_model_parallel_size=TP,
                            expert_model_parallel_size=EP):
        parallelize_model(model)   # meta tensors: nothing is communicated
    return {"dense_bytes": float(sum(dense.values())), "parameter_bytes": float(sum(
        p.numel() * p.element_size() for p in model.parameters())), "storage_bytes": float(held_bytes(
            model.parameters())), "ideal_bytes": experts / (TP * EP) + (sum(dense.values()) - experts) / TP}


def run(ctx) -> Dict[str, Any]:
    spec = QUICK if ctx.quick else FULL
    log("moe: Mixtral-8x7B bytes per rank at tp=8 x ep=8 on the meta device")
    with Pool(1) as pool:
        counted = [pool.call(case_mixtral_bytes, rank=r)[0] for r in (0, TP * EP - 1)]
    log("moe: dense stack (1 process) and TP2 x EP2 (4 gloo ranks), alternating")
    with Pool(1) as dense, Pool(4) as parallel:
        for pool, tp, ep in ((dense, 1, 1), (parallel, 2, 2)):
            pool.call(case_setup, spec=spec, tp=tp, ep=ep)
        sent = parallel.call(case_step, count_all_to_all=True)[0]["all_to_all_bytes"]
        pools = {"dense, 1 process": dense, "TP2 x EP2, 4 ranks": parallel}
        rounds = alternate(list(pools), spec["rounds"], lambda name: max(
            r["seconds"] for r in pools[name].call(case_step)), warmup=1, swap=True)
    return _result(spec, counted, sent, rounds)


def _result(spec, counted, sent: float, rounds) -> Dict[str, Any]:
    tokens = spec["batch"] * 4 // 2 * spec["seq"]   # per rank: the global batch over DP = 2
    # Per layer: the entry and the exit in forward and in backward, each E x C x H fp32 values, but for the first
    # layer's entry in backward: its input (the data) needs no gradient.
    formula = (4 * spec["layers"] - 1) * spec["experts"] * tokens * spec["hidden"] * 4
    worst = max(counted, key=lambda c: c["storage_bytes"])
    dense, parallel = (median(rounds[name]) for name in ("dense, 1 process", "TP2 x EP2, 4 ranks"))
    numbers = {"step_s_dense": dense, "step_s_tp2_ep2": parallel, "tp2_ep2_over_dense": parallel / dense,
               "all_to_all_bytes_per_step": sent, "all_to_all_bytes_formula": float(formula),
               "mixtral_percent_over_ideal": 100 * (worst["storage_bytes"] / worst["ideal_bytes"] - 1)}
    return {"spec": spec, "rounds": rounds, "mixtral": counted, **section([
        f"{spec['layers']} MoE layers (hidden {spec['hidden']}, intermediate {spec['intermediate']}, {spec['experts']} "
        f"experts, top-{spec['top_k']}, dropless), fp32, global batch {spec['batch'] * 4} x {spec['seq']}, a thread "
        f"per process; slowest rank, median of {spec['rounds']} alternating rounds: dense {dense:.3f} s, TP2 x EP2 "
        f"{parallel:.3f} s ({parallel / dense:.2f}x). All-to-all bytes per step: {sent:,.0f}; formula (4 x layers - 1) "
        f"x E x C x H x 4 B = {formula:,.0f} (entry and exit, forward and backward, less the first layer's entry in "
        f"backward; C = the rank's {tokens} tokens).",
        table({"rank": "rank", "parameter bytes|bytes": "parameter_bytes",
               "storage bytes held|bytes": "storage_bytes", "ideal (experts / 64, rest / 8)|bytes": "ideal_bytes",
               "over ideal %|.2f": lambda c: 100 * (c["storage_bytes"] / c["ideal_bytes"] - 1)},
              [dict(c, rank=r) for c, r in zip(counted, (0, TP * EP - 1))]),
        f"Mixtral-8x7B at tp={TP} x ep={EP}: {numbers['mixtral_percent_over_ideal']:.2f} % over the ideal (goal "
        f"{BYTES_GOAL_PERCENT} %; the replicated norms and routers are the difference)."], **numbers)}
