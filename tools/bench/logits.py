"""Section 10: what full-vocabulary logits cost (docs/performance.md, section 10). A Llama-shaped model at TP2 on
2 gloo ranks: the train step (forward with labels, backward) when the forward returns full-vocabulary logits (the
default) and inside ``vocab_parallel_logits`` (the shards), and the bytes of the logits each rank then holds."""

from __future__ import annotations

from typing import Any, Dict

from .common import Pool, alternate, hf_model, log, median, timed

FULL = dict(vocab=32000, hidden=256, layers=2, batch=4, seq=128, rounds=6)
QUICK = dict(vocab=1024, hidden=64, layers=1, batch=2, seq=16, rounds=2)
MODES = ("full logits (default)", "vocab_parallel_logits")
_STATE: Dict[str, Any] = {}


def case_setup(spec: Dict[str, int]) -> None:
    import torch

    from nxdtp.models import parallelize_model

    _STATE["model"] = parallelize_model(hf_model(dict(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=2 * spec["hidden"], num_hidden_layers=spec["layers"], tie_word_embeddings=False), "llama", 0))
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]))
    _STATE["batch"] = dict(input_ids=ids, labels=ids)


def case_step(mode: str) -> Dict[str, float]:
    import contextlib

    from nxdtp.models import vocab_parallel_logits
    from nxdtp.storage import held_bytes

    model, held = _STATE["model"], []

    def step():
        with vocab_parallel_logits(model) if mode == MODES[1] else contextlib.nullcontext():
            out = model(**_STATE["batch"])
        out.loss.backward()
        held.append(held_bytes([out.logits]))
        model.zero_grad(set_to_none=True)

    return {"seconds": timed(step), "logits_bytes": float(held[-1])}


def run(ctx) -> Dict[str, Any]:
    spec = QUICK if ctx.quick else FULL
    log("logits: Llama-shaped model at TP2 (2 gloo ranks), full logits against vocab_parallel_logits, alternating")
    with Pool(2, tp=2) as pool:
        pool.call(case_setup, spec=spec)
        results = {mode: pool.call(case_step, mode=mode)[0] for mode in MODES}
        rounds = alternate(list(MODES), spec["rounds"], lambda mode: max(
            r["seconds"] for r in pool.call(case_step, mode=mode)), warmup=1, swap=True)
    full, shards = (median(rounds[mode]) for mode in MODES)
    numbers = {"step_s_full_logits": full, "step_s_vocab_parallel": shards, "full_over_vocab_parallel": full / shards,
               "logits_bytes_full": results[MODES[0]]["logits_bytes"],
               "logits_bytes_vocab_parallel": results[MODES[1]]["logits_bytes"]}
    return {"spec": spec, "rounds": rounds, "numbers": numbers, "tables": [
        f"Llama-shaped, vocabulary {spec['vocab']}, hidden {spec['hidden']}, {spec['layers']} layers, batch "
        f"{spec['batch']} x {spec['seq']}, fp32, TP2 on 2 gloo ranks, a thread each; slowest rank, median of "
        f"{spec['rounds']} alternating rounds. Train step with full-vocabulary logits (the default) {full:.3f} s, "
        f"inside vocab_parallel_logits {shards:.3f} s: {full / shards:.2f}x. Logits bytes a rank holds after the "
        f"forward: {numbers['logits_bytes_full']:,.0f} (full, batch x seq x vocab x 4 B) against "
        f"{numbers['logits_bytes_vocab_parallel']:,.0f} (its shard)."]}
