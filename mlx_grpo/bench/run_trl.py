"""TRL's GRPOTrainer (PyTorch + PEFT) on the benchmark's work unit.

Runs in its own virtual environment (.venv-bench-trl: torch, trl, peft, transformers):

    python -m mlx_grpo.bench.run_trl --model HF_FOLDER --steps 4

The settings are the work unit's (mlx_grpo/bench/work_unit.py) spelled in
GRPOConfig/LoraConfig terms: 16 completions per step as 2 prompts x 8 generations,
float32 (bf16 off), no gradient checkpointing, LoRA on every linear layer of every
block, the reference being the base model with the adapter disabled (TRL's PEFT path).
Rollout time is the time spent in GRPOTrainer._generate (sampling only; the reference
and old log-probs TRL computes right after it count as update time).
"""

from __future__ import annotations

import tempfile
import time

from mlx_grpo.bench import work_unit as wu


def main(argv=None) -> None:
    args, clock = wu.peer_args("the work unit's weights as an HF folder", argv)

    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    torch.manual_seed(0)
    data = _dataset(args.steps)

    def correct(completions, answer, **kwargs):
        return [wu.reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    with tempfile.TemporaryDirectory() as out:
        config = _grpo_config(out, args.steps)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=correct,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=_lora_config(),
        )
        _time_steps(trainer, clock)
        trainer.train()
    versions = (
        f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}"
    )
    wu.emit(
        clock.result(
            "TRL",
            versions,
            device="cuda" if torch.cuda.is_available() else "cpu",
            threads=torch.get_num_threads(),
            trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            activation_checkpointing=bool(config.gradient_checkpointing),
            bf16=bool(config.bf16),
        )
    )


def _dataset(steps: int):
    """The prompts of `steps` steps, in step order: step s trains on tasks 2(s-1),
    2(s-1)+1, as in the other systems. TRL does not shuffle it (`shuffle_dataset=False`),
    and its RepeatSampler then yields each prompt G times, in order."""
    from datasets import Dataset

    rows = [wu.step_tasks(s) for s in range(1, steps + 1)]
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": t["prompt"]}], "answer": t["answer"]}
            for step in rows
            for t in step
        ]
    )


def _grpo_config(out: str, steps: int):
    """The work unit's settings in GRPOConfig terms (mlx_grpo/bench/work_unit.py), plus
    what keeps TRL's step the same work: float32 (bf16 and fp16 off), no gradient
    checkpointing, no shuffling, constant learning rate, no saving or reporting."""
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=wu.BATCH * wu.GROUP,
        gradient_accumulation_steps=1,
        num_generations=wu.GROUP,
        max_completion_length=wu.MAX_NEW_TOKENS,
        temperature=wu.TEMPERATURE,
        top_p=wu.TOP_P,
        top_k=wu.TOP_K,
        beta=wu.BETA,
        epsilon=wu.EPSILON,
        num_iterations=wu.NUM_ITERATIONS,
        loss_type=wu.LOSS_TYPE,
        scale_rewards="group",
        learning_rate=wu.LEARNING_RATE,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=wu.MAX_GRAD_NORM,
        weight_decay=0.0,
        max_steps=steps,
        shuffle_dataset=False,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )


def _lora_config():
    """The work unit's LoRA in PEFT terms; GRPOTrainer applies it and, as a PEFT model,
    takes the reference as the base model with the adapter disabled."""
    from peft import LoraConfig

    return LoraConfig(
        r=wu.LORA_RANK,
        lora_alpha=wu.LORA_ALPHA,
        lora_dropout=wu.LORA_DROPOUT,
        target_modules=wu.LORA_MODULES,
        task_type="CAUSAL_LM",
    )


def _time_steps(trainer, clock: wu.StepClock) -> None:
    """Record each step on `clock` as the other runners do: the step's time, its
    rollout (the time spent in GRPOTrainer._generate: sampling only; the reference and
    old log-probs TRL computes right after it count as update), tokens and reward. The
    record is written when TRL logs the step, the first moment its metrics are known."""
    from transformers import TrainerCallback

    generate = wu.TimeSpent(trainer._generate)
    trainer._generate = generate

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.tic = time.perf_counter()
            generate.seconds = 0.0

        def on_step_end(self, *a, **k):
            self.step_s = time.perf_counter() - self.tic
            self.rollout_s = generate.seconds

    clock_cb = Clock()
    trainer.add_callback(clock_cb)

    class Record(TrainerCallback):  # after logging: the step's metrics are known
        def on_log(self, _args, state, control, logs=None, **k):
            if not logs or "completions/mean_length" not in logs:
                return
            n = wu.BATCH * wu.GROUP
            clock.record(
                step_s=clock_cb.step_s,
                rollout_s=clock_cb.rollout_s,
                update_s=clock_cb.step_s - clock_cb.rollout_s,
                gen_tokens=round(logs["completions/mean_length"] * n),
                reward_mean=logs.get("reward"),
            )

    trainer.add_callback(Record())


if __name__ == "__main__":
    main()
