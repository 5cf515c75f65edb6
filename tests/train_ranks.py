"""Run ``training/train_heads.py`` in each process of a ``torchrun`` launch (tests/test_training_ranks.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train_ranks.py [--die-after-step N] FLAGS

``--die-after-step N``: the launch is killed (SIGKILL, no cleanup) right after checkpoint ``step-N`` is written,
as a crash or a preempted job would end it; torchrun then stops the other process.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import load_script  # noqa: E402

import selfspec.train.loop as loop  # noqa: E402


def die_after(step: int) -> None:
    """Make the checkpoint of ``step`` the run's last act."""
    save = loop.save_checkpoint

    def save_then_die(accelerator, out, at):
        save(accelerator, out, at)
        if at == step:
            accelerator.wait_for_everyone()
            os.kill(os.getpid(), signal.SIGKILL)

    loop.save_checkpoint = save_then_die


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--die-after-step"]:
        die_after(int(argv[1]))
        argv = argv[2:]
    sys.argv = ["train_heads.py", *argv]
    sys.exit(load_script("training/train_heads.py").main())
