"""Train selfspec draft heads on a frozen Hugging Face causal LM.

    accelerate launch training/train_heads.py --base-model smollm2-135m-instruct --family eagle \
        --data sharegpt --output-dir runs/smollm2-eagle
    python training/train_heads.py --config training/configs/smollm2-eagle.json --resume

Every flag is a field of selfspec.train.config.TrainConfig (see --help). Several GPUs or nodes: DDP (or FSDP2)
through accelerate (training/accelerate/*.yaml, or `accelerate config`); several processes on one CPU machine:
`torchrun --standalone --nproc_per_node N`. training/README.md has the exact commands.
"""

import sys

from selfspec.errors import SelfspecError
from selfspec.train.config import parse_config
from selfspec.train.loop import train


def main() -> int:
    """Parse flags, train, print the heads folder."""
    try:
        folder = train(parse_config())
        from accelerate import PartialState

        state = PartialState()
        if state.is_main_process:  # one line, not one per rank
            print(folder)
        state.wait_for_everyone()
        state.destroy_process_group()  # every process ends its gloo/NCCL threads before the interpreter exits
    except SelfspecError as exc:
        print(f"train_heads: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
