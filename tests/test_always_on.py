"""The callbacks each script adds beyond conf/callbacks/ (src/run/always_on.py), pinned: the ones train.py, eval.py and
generate.py each built themselves before that one list existed, in the same order, with the same arguments; and
each script hands its own list to its Trainer (train.py after conf/callbacks/'s)."""

from __future__ import annotations

import ast

import pytest
from conftest import FAST, ROOT, path_overrides
from omegaconf import OmegaConf
from test_configs import compose_cfg

from src.callbacks.essentials import ConfigInCheckpoint, CpuThreadsPerRank, StepsInProgressBar
from src.callbacks.resume_anywhere import ResumeAnywhere
from src.callbacks.trackers import TrackerRuns
from src.callbacks.user_module import UserModule
from src.run.always_on import always_on

TRAIN = [CpuThreadsPerRank, ConfigInCheckpoint, StepsInProgressBar, ResumeAnywhere, TrackerRuns, UserModule]


@pytest.mark.parametrize("given", [[], ["seed=7", "compile_dropout=false", "optimized_metric=val/ppl"]])
def test_train_py_gets_six(tmp_path, given):
    overrides = given + (["+resume_with_new_batch=true"] if given else [])
    cfg = compose_cfg(overrides, tmp=tmp_path)
    callbacks = always_on("train", cfg)
    assert [type(c) for c in callbacks] == TRAIN
    stored = callbacks[1].config  # ConfigInCheckpoint(cfg): the resolved model and data configs, the precision
    assert stored == {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "trainer": {"precision": cfg.trainer.precision},
    }
    assert callbacks[3].allow_new_batch is bool(given)  # +resume_with_new_batch
    user = callbacks[5]
    assert (user.seed, user.compile_dropout, user.optimized_metric) == (
        (7, False, "val/ppl") if given else (42, "auto", "val/loss")
    )


def test_a_train_run_without_a_seed_keys_its_dropout_with_zero(tmp_path):
    assert always_on("train", compose_cfg(["seed=null"], tmp=tmp_path))[5].seed == 0


@pytest.mark.parametrize("seed", ["7", "null"])
def test_eval_py_gets_two_and_generate_py_one(tmp_path, seed):
    cfg = compose_cfg([f"seed={seed}"], name="eval", tmp=tmp_path)
    cpu, user = always_on("eval", cfg)
    assert type(cpu) is CpuThreadsPerRank and type(user) is UserModule
    assert (user.seed, user.compile_dropout, user.optimized_metric) == (7 if seed == "7" else 0, "auto", None)
    assert [type(c) for c in always_on("generate", compose_cfg([], name="generate", tmp=tmp_path))] == [
        CpuThreadsPerRank
    ]
    with pytest.raises(ValueError, match="no script 'export'"):
        always_on("export", cfg)


def test_train_py_hands_conf_callbacks_then_its_six_to_the_trainer(tmp_path, dirs, monkeypatch):
    """A real train.py build (data, trainer, model), stopped before fitting: its Trainer's callbacks."""
    import train

    built = {}

    class Built(Exception):
        pass

    def stop(trainer, model, cfg):  # train.py's first call once the trainer and model exist
        built["trainer"] = trainer
        raise Built

    monkeypatch.setattr(train, "log_hyperparameters", stop)
    cfg = compose_cfg(FAST + path_overrides(dirs), tmp=tmp_path)
    with pytest.raises(Built):
        train.train(cfg)
    names = [type(c).__name__ for c in built["trainer"].callbacks]
    from_conf = [OmegaConf.select(cfg.callbacks, k)._target_.rsplit(".", 1)[1] for k in cfg.callbacks]
    ours = [c.__name__ for c in TRAIN]
    # Lightning puts its checkpoint callbacks last and adds its own (the progress bar, the model summary)
    checkpoints = [n for n in from_conf if n == "ModelCheckpoint"]
    assert [n for n in names if n in from_conf + ours] == [
        n for n in from_conf if n != "ModelCheckpoint"
    ] + ours + checkpoints


@pytest.mark.parametrize("script", ["eval", "generate"])
def test_eval_py_and_generate_py_give_their_trainer_their_own(script):
    calls = [
        node
        for node in ast.walk(ast.parse((ROOT / f"{script}.py").read_text()))
        if isinstance(node, ast.Call) and any(k.arg == "callbacks" for k in node.keywords)
    ]
    assert len(calls) == 1, f"{script}.py builds one Trainer"
    given = next(k.value for k in calls[0].keywords if k.arg == "callbacks")
    assert ast.unparse(given) == f"always_on('{script}', cfg)"
