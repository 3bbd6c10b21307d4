"""The loss against TRL's own: `GRPOTrainer._compute_loss` of TRL 1.16 (in
`.venv-parity`, made by `make parity-env`) runs on the same fixed per-token log-probs,
old and reference log-probs, advantages and mask as `per_token_loss` + `aggregate`, and
both give the same loss and d loss / d log-probs, for every loss type the two share, at
token level (GRPO) and at sequence level (GSPO), with and without the KL term.

TRL's method is called unbound on a stand-in trainer that holds only the attributes it
reads; its model call is replaced by one that returns the fixed log-probs as a leaf
tensor, so everything from the ratios to the aggregation is TRL's code.
"""

from __future__ import annotations

import json
import subprocess
from itertools import product

import mlx.core as mx
import numpy as np
from conftest import assert_f32_close, parity_python

from mlx_grpo.grpo import aggregate, per_token_loss

TRL_LOSS = r"""
import json, sys, types
from collections import defaultdict

import numpy as np
import torch
import trl
from trl.trainer.grpo_trainer import GRPOTrainer

assert trl.__version__ == "1.16.0", trl.__version__
data = np.load(sys.argv[1])
cases = json.loads(sys.argv[2])


class Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


out = {}
for k, case in enumerate(cases):
    logp = torch.tensor(data["logp"], requires_grad=True)
    mask = torch.tensor(data["mask"])
    n, c = logp.shape
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **kw: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=case["level"],
        beta=case["beta"],
        loss_type=case["loss_type"],
        epsilon_low=case["epsilon"],
        epsilon_high=case["epsilon_high"],
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        current_gradient_accumulation_steps=1,
        max_completion_length=case["max_new_tokens"],
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=Accelerator(),
    )
    inputs = {
        "prompt_ids": torch.ones(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.ones(n, c, dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(data["adv"]),
        "old_per_token_logps": torch.tensor(data["old"]),
        "ref_per_token_logps": torch.tensor(data["ref"]),
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    out[f"loss{k}"] = loss.detach().numpy()
    out[f"grad{k}"] = logp.grad.numpy()
np.savez(sys.argv[3], **out)
"""

CASES = [
    {"loss_type": t, "level": lv, "beta": b, "epsilon": e, "epsilon_high": eh, "max_new_tokens": 10}
    for t, lv, b, (e, eh) in product(
        ["grpo", "dr_grpo", "dapo"],
        ["token", "sequence"],
        [0.0, 0.04],
        [(0.2, 0.28), (3e-4, 4e-4)],  # DAPO's clip-higher; GSPO's paper's sequence clip
    )
]


def test_loss_and_gradient_equal_trls_compute_loss(tmp_path):
    py = parity_python()
    rng = np.random.default_rng(7)
    n, c = 12, 9
    logp = (-rng.random((n, c)) * 3).astype(np.float32)
    # Token and sequence ratios on both sides of both clip ranges.
    drift = rng.normal(0, 0.3, (n, c)) + rng.normal(0, 0.2, (n, 1))
    data = {
        "logp": logp,
        "old": (logp + drift).astype(np.float32),
        "ref": (logp + rng.normal(0, 0.2, (n, c))).astype(np.float32),
        "adv": rng.normal(0, 1, n).astype(np.float32),
        "mask": (rng.random((n, c)) > 0.3).astype(np.float32),
    }
    data["mask"][:, 0] = 1
    np.savez(tmp_path / "in.npz", **data)
    subprocess.run(
        [
            str(py),
            "-c",
            TRL_LOSS,
            str(tmp_path / "in.npz"),
            json.dumps(CASES),
            str(tmp_path / "out.npz"),
        ],
        check=True,
        timeout=600,
    )
    trl = np.load(tmp_path / "out.npz")
    mask = mx.array(data["mask"])
    for k, case in enumerate(CASES):

        def loss(lp, case=case):
            tok, *_ = per_token_loss(
                lp,
                mx.array(data["old"]),
                mx.array(data["ref"]),
                mx.array(data["adv"]),
                case["epsilon"],
                case["epsilon_high"],
                case["beta"],
                mask,
                case["level"],
            )
            return aggregate(tok, mask, case["loss_type"], case["max_new_tokens"])

        value, grad = mx.value_and_grad(loss)(mx.array(logp))
        # Each is a sum of at most n * c float32 terms, in either library.
        assert_f32_close(value.item(), trl[f"loss{k}"], n * c, f"loss {case}")
        assert_f32_close(np.array(grad), trl[f"grad{k}"], n * c, f"gradient {case}")
    # The cases are not vacuous: the tight sequence clip zeroes whole rows' gradients.
    tight = [k for k, c in enumerate(CASES) if c["epsilon"] < 1e-3 and c["beta"] == 0]
    assert all((trl[f"grad{k}"][data["mask"] > 0] == 0).any() for k in tight)
