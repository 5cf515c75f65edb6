"""Training with several processes, as ``accelerate launch`` / ``torchrun`` run it: two real ranks on this CPU
(gloo). Two processes of batch b train what one process of batch 2b does; a killed two-process run resumes to the
uninterrupted run's weights bit for bit; the ranks split every epoch without overlap; the feature cache two ranks
build is the one one process builds; one checkpoint, log and card; resuming with another number of processes is
refused; and a head family's registration is checked when it registers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import free_port, make_tokenizer, tiny_model
from selfspec.errors import SelfspecError
from selfspec.train.batches import epoch_order, rank_micro_batches, step_examples, steps_per_epoch
from selfspec.train.config import TrainConfig
from selfspec.train.loop import train

VOCAB = 272
HERE = Path(__file__).parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny model folder (weights and tokenizer), loaded by every process as users' models are."""
    folder = tmp_path_factory.mktemp("tiny-base")
    tiny_model(0, vocab=VOCAB, layers=2).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"say it {i % 7}"},
                                         {"role": "assistant", "content": " ".join(["abc def ghi"] * (2 + i % 5))}]}
            for i in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def settings(base: Path, chats: Path, out: Path, **kw) -> dict:
    """A short eagle run: 21 training conversations, so a step of 4 leaves one for the last step (one rank idle)."""
    return {"base_model": str(base), "dtype": "float32", "family": "eagle", "data": str(chats), "max_examples": 21,
            "max_length": 64, "heldout_fraction": 0.1, "output_dir": str(out), "epochs": 2, "batch_size": 2, "learning_rate": 1e-2,
            "warmup_steps": 1, "save_every": 2, "eval_examples": 6, "seed": 0, **kw}


def flags(values: dict) -> list[str]:
    out = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            for k, v in value.items():
                out += [flag.removesuffix("s"), f"{k}={json.dumps(v)}"]
        else:
            out += [flag, str(value)]
    return out


SHARD = 4  # feature-cache shards of 4 conversations: the two ranks each build several


def launch(argv: list[str]) -> subprocess.CompletedProcess:
    """Run a launcher and its ranks (one thread each; nothing tells accelerate it is on a CPU, as for users); a
    launch that hangs is killed with every rank it started."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += "\n(killed after 300 s)"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def two_ranks(values: dict, die_after: int | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2`` of the training script (gloo)."""
    return launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(HERE / "train_ranks.py"), "--shard-size", str(SHARD),
                   *(["--die-after-step", str(die_after)] if die_after else []), *flags(values)])


def two_ranks_fsdp(values: dict) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file training/accelerate/fsdp.yaml`` of the training script, FSDP2 on the CPU."""
    return launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(HERE.parent / "training" / "accelerate" / "fsdp.yaml"), "--num_processes", "2",
                   "--main_process_port", str(free_port()), str(HERE / "train_ranks.py"), "--fsdp-on-cpu",
                   "--shard-size", str(SHARD), *flags(values)])


def train_here(values: dict, monkeypatch) -> Path:
    """One process, in this one (its feature-cache shards as the ranks'): the reference."""
    import selfspec.train.features as features

    monkeypatch.setattr(features, "SHARD", SHARD)
    return train(TrainConfig(**values))


def heads_of(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "heads" / "heads.safetensors"))


def log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


HEAD_ARGS = {"eagle": {}, "eagle3": {"draft_vocab_size": 100}, "medusa": {"num_heads": 3},
             "early-exit": {"exit_layer": 1, "adapter": "layer"}}


@pytest.mark.parametrize("family", list(HEAD_ARGS))
def test_two_processes_train_what_one_process_trains_with_twice_the_batch(family: str, base: Path, chats: Path,
                                                                          tmp_path: Path, monkeypatch):
    """Every family (DDP needs each parameter in every step's loss, short batches and idle ranks included)."""
    kw = {"family": family, "head_args": HEAD_ARGS[family]}
    one = train_here(settings(base, chats, tmp_path / "one", batch_size=4, **kw), monkeypatch)
    run = two_ranks(settings(base, chats, tmp_path / "two", **kw))
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = heads_of(tmp_path / "one"), heads_of(tmp_path / "two")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)  # float sums over other splits: not bitwise
    assert one == tmp_path / "one" / "heads"
    steps_one = [r for r in log_rows(tmp_path / "one") if "loss" in r]
    steps_two = [r for r in log_rows(tmp_path / "two") if "loss" in r]
    assert [r["tokens"] for r in steps_one] == [r["tokens"] for r in steps_two]  # the same examples, step by step
    assert [r["loss"] for r in steps_two] == pytest.approx([r["loss"] for r in steps_one], rel=1e-4)
    assert steps_two[-1]["loss"] < steps_two[0]["loss"]  # it trained
    # the held-out metric is counted over both ranks' shares: the same as one process's
    evals = [[r["heldout_top1_by_depth"] for r in log_rows(tmp_path / d) if "heldout_top1_by_depth" in r]
             for d in ("one", "two")]
    assert evals[0] == evals[1] and len(evals[0]) == 2
    # the feature cache two ranks built (each its share of the shards) holds the tensors one process wrote
    caches = [next((tmp_path / d / "features").iterdir()) for d in ("one", "two")]  # one subfolder each
    shards = sorted(p.name for p in caches[0].glob("shard-*"))
    assert len(shards) == 6 and caches[0].name == caches[1].name
    assert shards == sorted(p.name for p in caches[1].iterdir() if p.name.startswith("shard-"))  # no .tmp left
    for name in shards:
        with safe_open(str(caches[0] / name), "pt") as x, safe_open(str(caches[1] / name), "pt") as y:
            assert set(x.keys()) == set(y.keys())
            assert all(torch.equal(x.get_tensor(k), y.get_tensor(k)) for k in x.keys())
    # one of everything: one log line per step, one checkpoint per save, one card, the folder printed once
    assert [r["step"] for r in steps_two] == list(range(1, len(steps_two) + 1))
    saved = sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir())
    assert saved == sorted(f"step-{s}" for s in range(2, len(steps_two) + 1, 2))  # no leftover .tmp folder
    assert "x 2 processes" in (tmp_path / "two" / "heads" / "README.md").read_text()
    printed = run.stdout.strip().splitlines()  # by the main process only
    assert printed == [line for line in printed if line.startswith("epoch ")] + [str(tmp_path / "two" / "heads")]
    assert [line.split(":")[0] for line in printed[:-1]] == ["epoch 0", "epoch 1"]
    recorded = json.loads((tmp_path / "two" / "train_config.json").read_text())
    assert (recorded["num_processes"], recorded["distribution"]) == (2, "MULTI_CPU")


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_weights(base: Path, chats: Path, tmp_path: Path):
    kw = {"save_every": 1, "dtype": "bfloat16"}  # a bf16 target under float32 heads, as on a real CPU run
    full = two_ranks(settings(base, chats, tmp_path / "full", **kw))
    assert full.returncode == 0, full.stderr[-3000:]
    cut = two_ranks(settings(base, chats, tmp_path / "cut", **kw), die_after=3)  # mid-epoch 0 (6 steps)
    assert cut.returncode != 0 and not (tmp_path / "cut" / "heads").exists()
    resumed = two_ranks(settings(base, chats, tmp_path / "cut", **kw, resume=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = heads_of(tmp_path / "full"), heads_of(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = {d: {r["step"]: r["loss"] for r in log_rows(tmp_path / d) if "loss" in r} for d in ("full", "cut")}
    assert losses["cut"] == losses["full"]  # steps 4.. logged by the resumed run, 1..3 by the killed one
    # resuming the two-process run in one process is refused in one line
    with pytest.raises(SelfspecError, match="ran with 2 processes, this launch has 1") as refused:
        train(TrainConfig(**settings(base, chats, tmp_path / "cut", **kw, resume=True, base_model="no/such-model")))
    assert "\n" not in str(refused.value)  # one line, and before the model loads (there is none to load)


@pytest.mark.parametrize("count,batch,world", [(21, 2, 2), (20, 2, 2), (17, 3, 4), (5, 4, 2), (9, 1, 3)])
def test_ranks_split_every_epoch_without_overlap(count: int, batch: int, world: int) -> None:
    """Each example once per epoch over all ranks and steps; every rank's share of a step differs from the others'
    and together they are the step one process of batch world x batch takes."""
    for epoch in range(2):
        order, seen = epoch_order(count, 7, epoch), []
        for step in range(steps_per_epoch(count, batch * world)):
            examples = step_examples(order, step, batch * world)
            shares = [sum(rank_micro_batches(examples, batch, r, world), []) for r in range(world)]
            assert sorted(sum(shares, [])) == sorted(examples)
            assert all(len(mb) <= batch for r in range(world) for mb in rank_micro_batches(examples, batch, r, world))
            assert len({len(rank_micro_batches(examples, batch, r, world)) for r in range(world)}) == 1  # as many
            seen += sum(shares, [])
        assert sorted(seen) == list(range(count))
    assert epoch_order(count, 7, 0) != epoch_order(count, 7, 1) or count < 3


def test_gradient_accumulation_steps_as_a_larger_batch(base: Path, chats: Path, tmp_path: Path) -> None:
    """The loss is divided once by the loss tokens of the whole step: two micro-batches of 2 accumulated step as one
    batch of 4 (a token weighs the same whatever micro-batch it lands in)."""
    train(TrainConfig(**settings(base, chats, tmp_path / "big", batch_size=4, epochs=1)))
    train(TrainConfig(**settings(base, chats, tmp_path / "acc", batch_size=2, gradient_accumulation_steps=2, epochs=1)))
    a, b = heads_of(tmp_path / "big"), heads_of(tmp_path / "acc")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", list(HEAD_ARGS))
def test_a_padded_batchs_loss_is_the_sum_of_its_rows(family: str) -> None:
    """What makes the step independent of how its examples are split: every family's loss of a right-padded batch is
    the sum of its rows' losses alone (a padded row's last token has no next token, as a lone row's has none)."""
    from selfspec.heads import init_heads
    from selfspec.train.features import pad_batch
    from selfspec.train.objectives import head_loss, loss_settings, prepare_heads, target_features

    target = tiny_model(0, vocab=VOCAB, layers=2)
    heads = init_heads(family, target, **HEAD_ARGS[family]).float()
    g = torch.Generator().manual_seed(1)
    rows = []
    for length in (9, 14, 6, 11):
        mask = torch.zeros(length, dtype=torch.long)
        mask[3:] = 1
        rows.append({"input_ids": torch.randint(0, VOCAB, (length,), generator=g), "loss_mask": mask})
    prepare_heads(heads, target, rows)
    if family == "eagle3":  # the padding's token 0 not draftable, the rows' own tokens all
        heads.set_draft_vocab(torch.zeros(VOCAB).index_fill(0, torch.cat([r["input_ids"] for r in rows]), 1) -
                              torch.nn.functional.one_hot(torch.tensor(0), VOCAB))
    args = loss_settings(family, {})

    def loss(items):
        batch = pad_batch(items)
        batch.update(target_features(target, heads, batch["input_ids"], batch["attention_mask"]))
        return head_loss(heads, target, batch, args)[0]

    with torch.no_grad():
        torch.testing.assert_close(loss(rows), sum(loss([r]) for r in rows), rtol=1e-5, atol=1e-4)


def test_a_family_is_checked_when_it_registers() -> None:
    from dataclasses import replace

    from selfspec.heads import FAMILIES, register_family

    eagle = FAMILIES["eagle"]
    with pytest.raises(SelfspecError, match="already registered"):
        register_family("eagle", config=eagle.config, module=eagle.module, drafter=eagle.drafter,
                        objective=eagle.objective)
    with pytest.raises(SelfspecError, match="objective lacks loss"):
        register_family("eagle", config=eagle.config, module=eagle.module, drafter=eagle.drafter,
                        objective=replace(eagle.objective, loss=None))
    with pytest.raises(SelfspecError, match="whose family is 'eagle-x'"):
        register_family("eagle-x", config=eagle.config, module=eagle.module, drafter=eagle.drafter,
                        objective=eagle.objective)
    assert "eagle-x" not in FAMILIES


def test_loss_settings_are_the_familys_own(tmp_path: Path) -> None:
    assert TrainConfig(family="eagle", loss_args={"unroll": 4}).loss.unroll == 4
    with pytest.raises(SelfspecError, match=r"unknown medusa loss settings \['unroll'\]"):
        TrainConfig(family="medusa", loss_args={"unroll": 4})
    with pytest.raises(SelfspecError, match="unroll must be >= 1"):
        TrainConfig(family="eagle3", loss_args={"unroll": 0})
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"family": "eagle", "eagle_unroll": 4}))
    from selfspec.train.config import parse_config

    with pytest.raises(SelfspecError, match="eagle_unroll -> unroll"):
        parse_config(["--config", str(old)])


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_fsdp2_trains_what_one_process_does(family: str, base: Path, chats: Path, tmp_path: Path, monkeypatch):
    """training/accelerate/fsdp.yaml on a CPU device mesh (gloo): the heads sharded over two ranks, two micro-batches
    of one accumulated per step, end as one process's with a batch of four (eagle3's LM head called outside its
    forward included; the short last step leaves one rank a weightless micro-batch), and are saved whole."""
    kw = {"family": family, "head_args": HEAD_ARGS[family], "epochs": 1}
    train_here(settings(base, chats, tmp_path / "one", batch_size=4, **kw), monkeypatch)
    run = two_ranks_fsdp(settings(base, chats, tmp_path / "fsdp", batch_size=1, gradient_accumulation_steps=2, **kw))
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "fsdp" / "train_config.json").read_text())["distribution"] == "FSDP"
    a, b = heads_of(tmp_path / "one"), heads_of(tmp_path / "fsdp")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    evals = [[r["heldout_top1_by_depth"] for r in log_rows(tmp_path / d) if "heldout_top1_by_depth" in r]
             for d in ("one", "fsdp")]
    assert evals[0] == evals[1]


@pytest.mark.parametrize("name,kind", [("single_gpu", "NO"), ("multi_gpu", "MULTI_GPU"), ("fsdp", "FSDP")])
def test_the_launch_configurations_load(name: str, kind: str) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(HERE.parent / "training" / "accelerate" / f"{name}.yaml"))
    assert str(config.distributed_type).split(".")[-1] == kind


def test_fsdp1_and_deepspeed_are_refused_in_one_line() -> None:
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from selfspec.train.loop import check_distribution

    check_distribution(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU))
    check_distribution(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True))
    for kind, name in ((DistributedType.FSDP, "FSDP version 1"), (DistributedType.DEEPSPEED, "DEEPSPEED")):
        with pytest.raises(SelfspecError, match=f"not {name}") as refused:
            check_distribution(SimpleNamespace(distributed_type=kind, is_fsdp2=False))
        assert "\n" not in str(refused.value)
