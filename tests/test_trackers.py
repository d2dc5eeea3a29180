"""logger=mlflow and logger=wandb (src/callbacks/trackers.py) against the real things: an `mlflow server` process on
localhost read back through MlflowClient, and W&B's offline run files read back with wandb's own record schema.
The kill -9 + resume case (one run, every step once) is tests/test_launchers.py's torchrun restart."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import FULL_MATRIX_ONLY, ROOT, path_overrides, run_script
from test_parity import GPT2, QUIET

from tests.helpers.trackers import mlflow_server, wandb_history, wandb_runs

mlflow = pytest.importorskip("mlflow", reason="needs the trackers extra (pip install -e '.[trackers]')")
pytest.importorskip("wandb", reason="needs the trackers extra (pip install -e '.[trackers]')")


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@FULL_MATRIX_ONLY  # suite time, 28 s: one run per job and its history stay (this file's other runs, test_scaleout.py's DDP multirun)
@pytest.mark.slow
def test_a_sweep_of_1_and_2_ranks_is_one_tracker_run_per_job_with_the_same_history(tmp_path):
    """`-m trainer.devices=1,2` under DDP, to an mlflow server and to W&B (offline) at once: one MLflow run per job
    (none from rank 1), tagged with the sweep and its overrides, params and the resolved config there, FINISHED;
    the 2-rank job's train/loss and val/loss at the same steps as the 1-process job's (within 1e-5); W&B: one run
    per job (was: wandb handed the first job's run to the second), both in the sweep's group, every step once."""
    from mlflow import MlflowClient

    dirs = {k: tmp_path / k for k in ("log_dir", "cache_dir")}
    with mlflow_server(tmp_path) as uri:
        run_script(
            "train.py",
            ["-m", "trainer=ddp", "trainer.devices=1,2", "logger=[mlflow,wandb]", f"logger.mlflow.tracking_uri={uri}"]
            + QUIET
            + GPT2
            + ["trainer.val_check_interval=3"]
            + path_overrides(dirs),
            env={"WANDB_API_KEY": "", "WANDB_MODE": "offline"},
        )
        client = MlflowClient(uri)
        (experiment,) = [e for e in client.search_experiments() if e.name == "train"]
        runs = sorted(client.search_runs([experiment.experiment_id]), key=lambda r: r.data.tags["sweep.job"])
        assert ["trainer.devices=1" in r.data.tags["sweep.overrides"] for r in runs] == [True, False]
        assert ["trainer.devices=2" in r.data.tags["sweep.overrides"] for r in runs] == [False, True]
        assert all(r.info.status == "FINISHED" for r in runs)
        assert [r.data.params["trainer/devices"] for r in runs] == ["1", "2"]
        assert all(r.data.params["data/global_batch_size"] == "8" for r in runs)
        assert all([a.path for a in client.list_artifacts(r.info.run_id)] == ["config_resolved.yaml"] for r in runs)
        for key, steps in (("train/loss", list(range(6))), ("val/loss", [2, 5])):
            one, two = (history(client, r.info.run_id, key) for r in runs)
            assert [s for s, _ in one] == [s for s, _ in two] == steps, key
            assert max(abs(a - b) for (_, a), (_, b) in zip(one, two)) < 1e-5, key
    sweep = next((dirs["log_dir"] / "train" / "multiruns").iterdir())
    for job in ("0", "1"):
        (run,) = wandb_runs(sweep / job / "wandb")
        assert run["group"] == sweep.name and run["exit_code"] == 0 and f"sweep.job={job}" in run["tags"]
        steps = [row["trainer/global_step"] for row in wandb_history(sweep / job / "wandb") if "train/loss" in row]
        assert steps == list(range(6))
    assert len({wandb_runs(sweep / job / "wandb")[0]["id"] for job in ("0", "1")}) == 2


def test_a_failed_run_is_marked_failed_with_the_steps_it_logged(tmp_path, monkeypatch):
    """A run whose step raises (here at step 3): MLflow's run is FAILED, W&B's exits 1, and both hold the steps
    logged before the failure under unsaved/ (no checkpoint holds them: a resume would train them again)."""
    import lightning as L
    from mlflow import MlflowClient

    from src.callbacks.trackers import MLflowTracker, TrackerRuns, WandbTracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    class Boom(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, i):
            if self.global_step == 3:
                raise RuntimeError("boom")
            loss = (self.w * batch[0]).sum()
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    loggers = [
        MLflowTracker("failing", uri),
        WandbTracker("failing", str(tmp_path), offline=True),
    ]
    trainer = L.Trainer(
        max_steps=6, logger=loggers, callbacks=[TrackerRuns()], log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 1)), batch_size=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), data)
    client = MlflowClient(uri)
    run = client.get_run(loggers[0].run_id)
    assert run.info.status == "FAILED"
    assert [s for s, _ in history(client, run.info.run_id, "unsaved/train/loss")] == [0, 1, 2]
    assert history(client, run.info.run_id, "train/loss") == []
    (wandb_run,) = wandb_runs(tmp_path / "wandb")
    assert wandb_run["exit_code"] == 1
    assert [r["trainer/global_step"] for r in wandb_history(tmp_path / "wandb") if "unsaved/train/loss" in r] == [
        0,
        1,
        2,
    ]


def test_a_tracker_without_its_package_is_one_sentence(tmp_path, monkeypatch):
    """logger=mlflow without MLflow installed: the sentence naming the extra (MLflow hidden from the import; a
    UserError is one line and exit 2 from train.py, tests/test_errors.py). In process: a child
    interpreter's imports would take 10-30 s of the suite."""
    import sys

    from src.callbacks.trackers import MLflowTracker
    from src.utils.errors import UserError

    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError, match=r"^logger=mlflow needs MLflow: pip install -e '\.\[trackers\]'$"):
        MLflowTracker("x", f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_an_unreachable_tracking_server_or_wandb_online_without_a_key_is_one_sentence(tmp_path, monkeypatch):
    """Both before the run starts: a tracking URI where no MLflow server answers (a closed port: refused at once,
    where MLflow's own client retries for minutes), and W&B asked to go online without an API key."""
    import socket

    from src.callbacks.trackers import MLflowTracker, WandbTracker
    from src.utils.errors import UserError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    with pytest.raises(
        UserError, match=rf"^logger.mlflow.tracking_uri=http://127.0.0.1:{port}: no MLflow server answers"
    ):
        MLflowTracker("x", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(UserError, match=r"^logger.wandb.offline=false needs a W&B API key: set WANDB_API_KEY"):
        WandbTracker("x", str(tmp_path), offline=False)


@pytest.mark.parametrize(
    "args, sentence",
    [
        (["logger=nosuch"], "logger=nosuch: no such option in conf/logger/: use one of csv, many, mlflow, none,"),
        (["logger=[many,mlfow]"], "logger=mlfow: no such option in conf/logger/"),
        (["model/size=huge"], "model/size=huge: no such option in conf/model/size/"),
    ],
)
def test_an_unknown_logger_or_other_option_is_one_sentence(args, sentence):
    """An option conf/ lacks: one sentence listing the ones there, exit 2 (was Hydra's paragraph, exit 1); the
    options it has, sweeps of them and Hydra's functions pass."""
    from test_errors import assert_one_clear_line

    from src.launch.choices import unknown_choice

    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert_one_clear_line(proc.returncode, proc.stdout + proc.stderr, sentence)
    for fine in (["logger=[many,mlflow]"], ["-m", "logger=csv,wandb"], ["model=glob(*)"], ["experiment=null"]):
        assert unknown_choice(fine) is None, fine
