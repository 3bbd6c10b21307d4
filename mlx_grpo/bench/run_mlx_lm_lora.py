"""mlx-lm-lora's GRPO trainer (`mlx_lm_lora.trainer.grpo_trainer.train_grpo`) on the
benchmark's work unit.

Runs in its own virtual environment (.venv-bench-mlxlmlora: mlx-lm-lora, mlx[cpu]);
importing mlx_grpo first loads the BLAS that the bench chose for mlx-grpo
(passed as MLX_GRPO_OPENBLAS), so both MLX systems use the same BLAS:

    python -m mlx_grpo.bench.run_mlx_lm_lora --model HF_FOLDER --steps 4

The model, the LoRA layers and the reference model are made the way mlx-lm-lora's
own CLI makes them (`from_pretrained`, then a second `load` of the same weights as
the frozen reference). Its `batch_size` is the number of prompts per step (B);
`group_size` is G. Rollout time is the time spent in its `generate_grpo`.
"""

from __future__ import annotations

import tempfile
import time

from mlx_grpo.bench import work_unit as wu  # first: loads OpenBLAS before mlx


def main(argv=None) -> None:
    args, clock = wu.peer_args("the work unit's weights (float32 folder)", argv)

    import importlib.metadata

    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.utils import load
    from mlx_lm_lora.trainer import grpo_trainer
    from mlx_lm_lora.utils import from_pretrained

    from mlx_grpo.device import blas_in_use

    mx.random.seed(0)
    model, tokenizer, _ = from_pretrained(
        model=args.model,
        lora_config={
            "rank": wu.LORA_RANK,
            "dropout": wu.LORA_DROPOUT,
            "scale": wu.LORA_SCALE,
            "num_layers": 10**6,  # every block
        },
    )
    ref_model, _ = load(args.model)
    ref_model.freeze()

    def encode(t):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": t["prompt"]}], add_generation_prompt=True, tokenize=True
        )
        return (list(ids), tokenizer.encode(str(t["answer"])), t["prompt"], str(t["answer"]), None)

    def in_step_order(dataset, batch_size, max_seq_length, train=False):
        """Step s gets the work unit's tasks of step s (the library's own iterator
        sorts by length and shuffles)."""
        step = 1
        while True:
            batch = [encode(t) for t in wu.step_tasks(step)]
            yield tuple(list(col) for col in zip(*batch[:batch_size]))
            step += 1

    def correct(prompts, completions, answer, types=None):
        return [wu.reward(c, int(a)) for c, a in zip(completions, answer)]

    generate = wu.TimeSpent(grpo_trainer.generate_grpo)
    grpo_trainer.generate_grpo = generate
    last = [0.0]

    class Record(TrainingCallback):
        def on_train_loss_report(self, info):
            now = time.perf_counter()
            step_s, last[0] = now - last[0], now
            clock.record(
                step_s=step_s,
                rollout_s=generate.seconds,
                update_s=step_s - generate.seconds,
                gen_tokens=round(info["train_average_generated_tokens"] * wu.BATCH * wu.GROUP),
                reward_mean=info.get("train_total_rewards_mean"),
                mlx_peak_gb=info.get("peak_memory"),
            )
            generate.seconds = 0.0

    with tempfile.TemporaryDirectory() as out:
        targs = grpo_trainer.GRPOTrainingArgs(
            batch_size=wu.BATCH,
            iters=args.steps,
            group_size=wu.GROUP,
            beta=wu.BETA,
            epsilon=wu.EPSILON,
            max_completion_length=wu.MAX_NEW_TOKENS,
            temperature=wu.TEMPERATURE,
            top_p=wu.TOP_P,
            top_k=wu.TOP_K,
            grpo_loss_type=wu.LOSS_TYPE,
            steps_per_report=1,
            steps_per_eval=10**6,
            steps_per_save=10**6,
            adapter_file=f"{out}/adapters.safetensors",
            grad_checkpoint=False,
        )
        optimizer = optim.AdamW(learning_rate=wu.LEARNING_RATE, weight_decay=0.0)
        last[0] = time.perf_counter()
        grpo_trainer.train_grpo(
            model=model,
            ref_model=ref_model,
            tokenizer=tokenizer,
            optimizer=optimizer,
            train_dataset=[encode(t) for t in wu.tasks()],
            val_dataset=None,
            reward_funcs=[correct],
            args=targs,
            iterate_batches=in_step_order,
            training_callback=Record(),
            end_answer_token="",  # stop at EOS only, like the other systems
        )
    version = f"mlx-lm-lora {importlib.metadata.version('mlx-lm-lora')}, mlx {mx.__version__}"
    wu.emit(
        clock.result(
            "mlx-lm-lora",
            version,
            blas=blas_in_use(),
            device=str(mx.default_device()),
            trainable_params=sum(v.size for _, v in tree_flatten(model.trainable_parameters())),
        )
    )


if __name__ == "__main__":
    main()
