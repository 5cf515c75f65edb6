"""Train selfspec draft heads on a frozen Hugging Face causal LM.

    accelerate launch training/train_heads.py --base-model smollm2-135m-instruct --family eagle \
        --data sharegpt --output-dir runs/smollm2-eagle
    python training/train_heads.py --config training/configs/smollm2-eagle.json --resume

Every flag is a field of selfspec.train.config.TrainConfig (see --help). Multi-GPU and multi-node
runs use accelerate's own configuration (`accelerate config`: DDP; FSDP or DeepSpeed configs work
unchanged since only the heads are trained and the target is frozen).
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

        if PartialState().is_main_process:  # one line, not one per rank
            print(folder)
    except SelfspecError as exc:
        print(f"train_heads: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
