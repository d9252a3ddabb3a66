"""One process, real DeepSpeed ZeRO-3 on the CPU (gloo, world size 1): the kept-mass probe on a tied LM head that
DeepSpeed holds AVAILABLE at the probe's hook, while ``embed_tokens`` still counts it active.

Usage: python zero3_tied_head_worker.py OUT_JSON PORT [--support PATH] (PATH: another rollout/support.py, e.g. the
one before the F6 fix, loaded in its place). Writes per step: the weight's ZeRO status at the hook, log M and the
loss, or the error; and log M of a plain (unsharded) copy of the same weights, for comparison.

What is real and what stands in: the engine, its partitioning and its reuse tracking are DeepSpeed's own. From the
second step on, DeepSpeed keeps the tied weight AVAILABLE after the backbone (its reuse distance; measured here). On a
GPU, TRL's ``maybe_gather_lm_head_ctx`` says ``embed_tokens`` then still holds it in its active-submodule set; on
this CPU run the set is empty at the hook, so that one mark is added by a hook of this worker (and removed before
``lm_head`` runs): the state in which re-partitioning the weight collides with DeepSpeed (``free_param`` refuses).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])

import torch  # noqa: E402
import deepspeed  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from trl_rollout_corr.core.truncation import SamplingTruncation  # noqa: E402


def load_support():
    if "--support" not in sys.argv:
        from trl_rollout_corr.rollout import support
        return support
    path = sys.argv[sys.argv.index("--support") + 1]
    spec = importlib.util.spec_from_file_location("trl_rollout_corr.rollout._support_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    support = load_support()
    deepspeed.init_distributed(dist_backend="gloo")
    config = Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=True)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}  # lr 0: the weights stay those of step 0
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    weight, embed = model.lm_head.weight, model.model.embed_tokens
    truncation = SamplingTruncation(temperature=1.0, top_p=0.8)
    state = {}

    def embed_holds_it(module, args, kwargs, output):  # runs before the probe's hook (registered first)
        state["status"] = weight.ds_status.name
        if weight.ds_status.name == "AVAILABLE":
            weight.ds_active_sub_modules.add(embed.ds_id)

    def release_mark(module, args):  # before lm_head's own fetch and release
        weight.ds_active_sub_modules.discard(embed.ds_id)

    model.model.register_forward_hook(embed_holds_it, with_kwargs=True)
    model.lm_head.register_forward_pre_hook(release_mark)
    input_ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(1))  # (1, L)
    steps = []
    for _ in range(3):
        try:
            with support.KeptMassProbe(engine, truncation, 5) as probe:
                out = engine(input_ids=input_ids, labels=input_ids)
            engine.backward(out.loss)
            engine.step()
            log_mass, _ = probe.result()
            steps.append({"status": state["status"], "log_mass": log_mass[0].tolist(), "loss": float(out.loss)})
        except Exception as error:  # noqa: BLE001 (reported to the test)
            weight.ds_active_sub_modules.discard(embed.ds_id)
            steps.append({"status": state.get("status"), "error": f"{type(error).__name__}: {error}"})
            break
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        plain_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain = Qwen2ForCausalLM(config).eval()
    plain.load_state_dict(plain_state)
    with support.KeptMassProbe(plain, truncation, 5) as probe:
        plain(input_ids=input_ids)
    with open(sys.argv[1], "w") as f:
        json.dump({"steps": steps, "plain_log_mass": probe.result()[0][0].tolist()}, f)


if __name__ == "__main__":
    main()
