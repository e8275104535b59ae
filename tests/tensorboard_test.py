#!/usr/bin/env python3
"""TensorBoard event files of a training run, read with tensorboard's own reader.

tessera-trainer trains a tiny model from --set settings for 6 steps with a checkpoint directory and
evaluation every 3 steps; rank 0 writes <checkpoint_dir>/tensorboard/events.out.tfevents.*.
tensorboard's EventAccumulator (the reader behind `tensorboard --logdir`) must load the file and
find:
  * train/loss at steps 1-6 equal to the losses the trainer reported on stdout (float32);
  * train/learning_rate, train/grad_norm, train/tokens_per_second at every step;
  * eval/loss at steps 3 and 6 equal to the reported evaluations;
  * the job's spec and plan as text.
A resumed attempt appends a second event file to the same directory.

Exit code 77 (ctest's skip) when the tensorboard package is not installed. No downloads.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from trainer_spec import spec_args  # noqa: E402

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as error:  # pragma: no cover - depends on the venv
    print(f"SKIP: {error} (scripts/bootstrap.sh installs tensorboard into the torch venv)")
    sys.exit(77)


def run(trainer, *args):
    result = subprocess.run([trainer, *args], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def reports_of(stdout):
    steps, evals = {}, {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
            if "metrics" in report:
                steps[int(report["metrics"]["step"])] = float(report["metrics"]["loss"])
            if "eval" in report:
                evals[int(report["eval"]["step"])] = float(report["eval"]["loss"])
    return steps, evals


def load(directory):
    accumulator = EventAccumulator(directory, size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def close(a, b):
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--corpus", required=True)
    args = parser.parse_args()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        run(args.trainer, "prepare", f"--input={args.corpus}", f"--output_dir={data}")
        shards = os.path.join(data, "train-*.bin")
        val = os.path.join(data, "val-*.bin")
        ckpt = os.path.join(tmp, "ckpt")
        spec = {"name": "tb", "model": {"preset": "tiny-gpt2"},
                "data": {"train_shards": [shards], "validation_shards": [val], "seq_len": 32,
                         "eval_interval_steps": 3, "eval_batches": 2},
                "batch": {"global_batch_size": 4, "micro_batch_size": 2},
                "optimizer": {"schedule": {"peak_learning_rate": 3e-3, "warmup_steps": 10,
                                           "min_lr_ratio": 0.1},
                              "weight_decay": 0.1, "grad_clip_norm": 1.0},
                "checkpoint": {"directory": ckpt, "interval_steps": 3}}
        result = run(args.trainer, *spec_args({**spec, "max_steps": 6}))
        losses, evals = reports_of(result.stdout)
        assert sorted(losses) == list(range(1, 7)), result.stdout
        assert sorted(evals) == [3, 6], result.stdout

        tb_dir = os.path.join(ckpt, "tensorboard")
        files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
        if len(files) != 1:
            failures.append(f"expected one event file in {tb_dir}, found {files}")
        events = load(tb_dir)
        tags = events.Tags()
        print(f"scalars: {sorted(tags['scalars'])}")
        print(f"tensors: {sorted(tags['tensors'])}")
        written = {e.step: e.value for e in events.Scalars("train/loss")}
        if sorted(written) != sorted(losses):
            failures.append(f"train/loss steps {sorted(written)} != reported {sorted(losses)}")
        for step, loss in losses.items():
            if step in written and not close(written[step], loss):
                failures.append(f"train/loss at step {step}: {written[step]} != {loss}")
        for tag in ("train/learning_rate", "train/grad_norm", "train/tokens_per_second"):
            steps = [e.step for e in events.Scalars(tag)]
            if steps != list(range(1, 7)):
                failures.append(f"{tag} at steps {steps}")
        written_evals = {e.step: e.value for e in events.Scalars("eval/loss")}
        for step, loss in evals.items():
            if step not in written_evals or not close(written_evals[step], loss):
                failures.append(f"eval/loss at step {step}: {written_evals.get(step)} != {loss}")
        for tag in ("job/spec", "job/plan"):
            if tag not in tags["tensors"]:
                failures.append(f"no {tag} text")
                continue
            text = events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
            print(f"{tag}: {len(text)} characters")
            if tag == "job/spec" and "seq_len: 32" not in text:
                failures.append(f"job/spec does not show the spec: {text[:200]}")
        print(f"train/loss from TensorBoard: "
              f"{', '.join(f'{s}: {v:.4f}' for s, v in sorted(written.items()))}")

        # A resumed attempt adds its own file next to the first.
        run(args.trainer, *spec_args({**spec, "max_steps": 8}))
        files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
        if len(files) != 2:
            failures.append(f"after the resumed run: {len(files)} event files, expected 2")
        steps = sorted(e.step for e in load(tb_dir).Scalars("train/loss"))
        if steps[-2:] != [7, 8]:
            failures.append(f"the resumed run's steps 7-8 are missing: {steps}")

    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
