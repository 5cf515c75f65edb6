"""Run ``training/train_heads.py`` in each process of a ``torchrun`` launch (tests/test_training_ranks.py).

    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT tests/train_ranks.py [OPTIONS] FLAGS

``--die-after-step N``: the launch is killed (SIGKILL, no cleanup) right after checkpoint ``step-N`` is written,
as a crash or a preempted job would end it; torchrun then stops the other process.

``--shard-size N``: feature-cache shards of N conversations (64 by default), so that a small run has several.

``--fsdp-on-cpu`` (under ``accelerate launch --config_file training/accelerate/fsdp.yaml``): accelerate runs FSDP
on accelerators only and falls back to DDP on a CPU; this lets its FSDP2 path run on the CPU's gloo group
(torch's ``fully_shard`` works there), so the loop's FSDP code runs as on GPUs.
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


def fsdp_on_cpu() -> None:
    """accelerate's state keeps the FSDP plugin it was given where it would otherwise settle for MULTI_CPU."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__

    def init_fsdp(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if kwargs.get("fsdp_plugin") is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = kwargs["fsdp_plugin"]
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    state.AcceleratorState.__init__ = init_fsdp


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--fsdp-on-cpu"]:
        fsdp_on_cpu()
        argv = argv[1:]
    if argv[:1] == ["--shard-size"]:
        import selfspec.train.features as features

        features.SHARD = int(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--die-after-step"]:
        die_after(int(argv[1]))
        argv = argv[2:]
    sys.argv = ["train_heads.py", *argv]
    sys.exit(load_script("training/train_heads.py").main())
