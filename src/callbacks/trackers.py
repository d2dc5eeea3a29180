"""Experiment trackers (`logger=mlflow`, `logger=wandb`): one tracker run per job whatever the number of ranks, the
same run continued when the job resumes, a sweep's jobs tagged and grouped, a failed run marked failed, and each
step's metrics in the run once.

Lightning's MLFlowLogger and WandbLogger, with what a distributed, resumable job needs beyond them:

- Rank 0 alone creates and writes the run (Lightning's loggers act on global rank 0 only, which Lightning reads
  from the environment under its own launcher, torchrun and SLURM alike; the others never reach the tracker).
- The run's id goes into every checkpoint (`checkpoint["trackers"]`, by `TrackerRuns`) and `loggers()` hands it
  back before the run starts, so `resume=auto` and `ckpt_path=` continue the run rather than open a new one.
- Every step once (`flush: checkpoint`, the default): a metric point is sent once a checkpoint holds its step, or
  when the run ends; the points of steps after the newest checkpoint wait on rank 0. A job killed after step 8
  with its checkpoint at step 5 has sent the steps before 5; the resumed job logs 5 onward, once. MLflow: the
  points waiting when a checkpoint is written ride in it, are sent once the file is complete and again on resume
  (MLflow stores an identical point once), so no kill loses or doubles one. W&B (no such dedup) is sent them as
  the checkpoint starts to be written: a kill during the write doubles those steps. A run that fails sends its
  waiting points under `unsaved/<metric>` (visible; the steps a resume trains again stay once under their name).
  The price: curves advance checkpoint by checkpoint. `flush: step` sends each point at once (live curves),
  and after a crash the steps between the checkpoint and the crash are in the run twice.
- A multirun: one run per job, tagged with the sweep dir, job number and overrides; W&B: one group per sweep, and
  each job's run finished at its end (wandb hands a run still open in the process to the next job otherwise:
  lightning-hydra-template #289, one run for a whole sweep).
- A run that fails (an exception, divergence) is marked failed (Lightning's `finalize("failed")`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
from hydra.utils import get_class
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from src.checkpoint.convert import read_stored
from src.utils.config import ConfigError, flatten, instantiate_group
from src.utils.errors import UserError

FLUSH = ("checkpoint", "step")
Point = tuple[str, float, int, int]  # key, value, timestamp (ms), step


def sweep_tags() -> dict[str, str]:
    """The Hydra job's place in a multirun (none in a single run)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return {}
    job = HydraConfig.get()
    return {
        "sweep": str(Path(job.sweep.dir)),
        "sweep.job": str(job.job.num),
        "sweep.overrides": job.job.override_dirname or "(none)",
    }


class Tracker:
    """What both trackers add: points held until a checkpoint holds their step (see the module's docstring).

    A point is final once a checkpoint holds it: it was logged before the checkpoint was saved, or after it with a
    step below the checkpoint's (the step's own train metrics, logged once the callbacks have run). Final points
    go to `ready` and are sent at the next log call (the save has returned by then), the others wait in `pending`."""

    key = "tracker"
    dedupes = False  # whether the tracker stores a point sent twice (same key, step, time and value) once

    def setup_tracker(self, flush: str, resume: Optional[dict]) -> None:
        if flush not in FLUSH:
            raise ConfigError(f"logger.{self.key}.flush={flush!r}: use checkpoint or step.")
        self.flush, self.pending, self.ready = flush, [], []
        # the points a killed attempt had not sent, from the checkpoint this run resumed from
        self.ready = [tuple(p) for p in (resume or {}).get("pending", [])]
        self.final_below = int((resume or {}).get("step", -1))

    def hold(self, metrics: Mapping[str, Any], step: Optional[int]) -> None:
        stamp, step = int(time.time() * 1000), int(step or 0)
        points = [(k, float(v), stamp, step) for k, v in metrics.items() if not isinstance(v, str)]
        final = self.flush == "step" or step < self.final_below
        (self.ready if final else self.pending).extend(points)
        self.send_ready()

    def send_ready(self) -> None:
        points, self.ready = self.ready, []
        if points:
            self.send(points)

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint at `step` keeps: the run's id, and (a tracker that dedupes) the points not sent yet,
        sent once the save has returned and again on resume. A tracker that does not dedupe is sent them now,
        before the file is written."""
        self.ready, self.pending = self.ready + self.pending, []
        self.final_below = max(self.final_below, step)
        if not self.dedupes:
            self.send_ready()
        return {"run_id": self.tracker_run_id(), "pending": [list(p) for p in self.ready], "step": step}

    def release(self, failed: bool = False) -> None:
        """At the end: every point; a failed run's points no checkpoint holds under `unsaved/<key>` (a resume trains
        their steps again)."""
        self.send_ready()
        points, self.pending = self.pending, []
        if points:
            self.send([(f"unsaved/{k}", *rest) for k, *rest in points] if failed else points)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.send_ready()  # the file is complete
        super().after_save_checkpoint(checkpoint_callback)  # the Lightning logger's (checkpoints as artifacts)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.release(failed=status == "failed")
        super().finalize(status)

    def send(self, points: list[Point]) -> None:
        raise NotImplementedError

    def tracker_run_id(self) -> Optional[str]:
        raise NotImplementedError


class MLflowTracker(Tracker, MLFlowLogger):
    """MLflow: params from the whole config (flattened, values up to MLflow's 6000 characters; on resume a changed
    value is recorded as the tag `resumed_with.<param>`, MLflow refusing to change a param), the resolved config
    as an artifact, checkpoints as artifacts when `log_model` asks."""

    key = "mlflow"
    dedupes = True

    def __init__(
        self,
        experiment_name: str,
        tracking_uri: str,
        run_name: Optional[str] = None,
        tags: Optional[dict[str, Any]] = None,
        log_model: bool | str = False,
        config_file: Optional[str] = None,
        flush: str = "checkpoint",
        artifact_location: Optional[str] = None,
        resume: Optional[dict] = None,
    ) -> None:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise UserError("logger=mlflow needs MLflow: pip install -e '.[trackers]'") from None
        if tracking_uri.startswith(("http://", "https://")) and rank_zero_only.rank == 0:
            check_server(tracking_uri)
        run_id = (resume or {}).get("run_id")
        all_tags = {**sweep_tags(), **{str(k): str(v) for k, v in (tags or {}).items()}}
        if artifact_location is None and tracking_uri.startswith("sqlite:///"):  # else MLflow's ./mlruns in the cwd
            artifact_location = str(Path(tracking_uri[len("sqlite:///") :]).parent / "mlflow-artifacts")
        # MlflowClient opens its store when built, and every rank creating one SQLite store at once fails ("table
        # experiments already exists", seen under srun). The other ranks never use theirs (Lightning's
        # rank_zero_experiment): it points at a server that is not asked anything.
        store = tracking_uri if rank_zero_only.rank == 0 else "http://127.0.0.1:9"
        super().__init__(
            experiment_name,
            run_name,
            store,
            all_tags,
            log_model=log_model,
            artifact_location=artifact_location,
            run_id=run_id,
        )
        self.config_file = config_file
        self.setup_tracker(flush, resume)
        self.continued = run_id is not None

    def tracker_run_id(self) -> Optional[str]:
        return self.run_id

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        from mlflow.entities import Param, RunStatus

        params = {k: str(v)[:6000] for k, v in flatten(params if isinstance(params, dict) else vars(params))}
        client, run_id = self.experiment, self.run_id
        if self.continued:  # the same run again: its params stay; what changed becomes a tag
            client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = client.get_run(run_id).data.params
            for k, v in params.items():
                if k in logged and logged[k] != v:
                    client.set_tag(run_id, f"resumed_with.{k}", v[:5000])
            params = {k: v for k, v in params.items() if k not in logged}
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's most params per call
            client.log_batch(run_id, params=items[i : i + 100])
        if self.config_file and Path(self.config_file).is_file():
            client.log_artifact(run_id, self.config_file)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        self.hold({re.sub(r"[^a-zA-Z0-9_/. -]+", "", k): v for k, v in metrics.items()}, step)

    def send(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, stamp, step) for k, v, stamp, step in points]
        for i in range(0, len(metrics), 1000):  # MLflow's most metrics per call
            self.experiment.log_batch(self.run_id, metrics=metrics[i : i + 1000])


class WandbTracker(Tracker, WandbLogger):
    """Weights & Biases: offline unless an API key is set (`offline: auto`; the run is written under the run dir's
    wandb/ and `wandb sync` uploads it later), the sweep's jobs in one group, each job's run finished at its end."""

    key = "wandb"

    def __init__(
        self,
        project: str,
        save_dir: str,
        name: Optional[str] = None,
        group: Optional[str] = None,
        tags: Optional[list[str]] = None,
        offline: bool | str = "auto",
        log_model: bool | str = False,
        flush: str = "checkpoint",
        resume: Optional[dict] = None,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError("logger=wandb needs Weights & Biases: pip install -e '.[trackers]'") from None
        if offline == "auto":
            offline = not wandb_key_known()
        elif not offline and not wandb_key_known() and rank_zero_only.rank == 0:
            raise UserError(
                "logger.wandb.offline=false needs a W&B API key: set WANDB_API_KEY or run `wandb login`, or leave "
                "logger.wandb.offline=auto to write the run offline and `wandb sync` it later."
            )
        if wandb.run is not None:  # the previous job's run in this process (a multirun): ended, not continued
            wandb.finish()
        sweep = sweep_tags()
        run_id = (resume or {}).get("run_id")
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(
            name=name,
            save_dir=save_dir,
            offline=bool(offline),
            id=run_id,
            project=project,
            log_model=log_model,
            group=group or (Path(sweep["sweep"]).name if sweep else None),
            tags=list(tags or []) + ([f"sweep.job={sweep['sweep.job']}"] if sweep else []),  # W&B: 64 characters
            resume="allow" if run_id else None,
        )
        self.setup_tracker(flush, resume)

    def tracker_run_id(self) -> Optional[str]:
        return self.version

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        super().log_hyperparams({**params, **sweep_tags()})  # the sweep and its overrides in the run's config

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        self.hold(metrics, step)

    def send(self, points: list[Point]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for k, v, _, step in points:
            by_step.setdefault(step, {})[k] = v
        for step in sorted(by_step):
            self.experiment.log({**by_step[step], "trainer/global_step": step})

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if status == "failed":  # else it stays open for trainer.test; the next job or the exit finishes it
            self.experiment.finish(exit_code=1)


def check_server(uri: str, timeout_s: float = 5.0) -> None:
    """One sentence, before the run starts, when no MLflow server answers at `uri` (MLflow's client would retry
    for minutes)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as response:
            if response.status == 200:
                return
            why = f"HTTP {response.status}"
    except OSError as e:
        why = str(getattr(e, "reason", e))
    raise UserError(
        f"logger.mlflow.tracking_uri={uri}: no MLflow server answers there ({why}): start one (mlflow server "
        "--host ... --port ...) or leave tracking_uri at its default, a local SQLite file."
    )


def wandb_key_known() -> bool:
    """Whether W&B could log in: WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc."""
    import netrc
    import os

    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class TrackerRuns(L.Callback):
    """Puts each tracker's run id and unsent points into every checkpoint, under `checkpoint["trackers"]`."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        trackers = [lg for lg in trainer.loggers if isinstance(lg, Tracker)]
        if trackers and trainer.is_global_zero:
            checkpoint["trackers"] = {t.key: t.checkpoint_state(trainer.global_step) for t in trackers}


def loggers(cfg: Optional[DictConfig], ckpt_path: Optional[str]) -> list[Any]:
    """The `logger` group's loggers; a tracker is given the run a checkpoint it resumes from was logged to (read on
    rank 0, the only rank that writes to a tracker)."""
    stored = (read_stored(ckpt_path, "trackers") or {}) if ckpt_path and rank_zero_only.rank == 0 else {}

    def resume(node: DictConfig) -> dict:
        cls = get_class(node._target_)
        run = stored.get(cls.key) if isinstance(cls, type) and issubclass(cls, Tracker) else None
        return {"resume": run} if run else {}

    return instantiate_group(cfg, "logger", resume)
