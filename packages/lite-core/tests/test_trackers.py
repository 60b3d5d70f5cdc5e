"""The tracker loggers without their trackers: the install line at construction, the user's config
in its three forms, the checkpointable state, and nothing done (nothing imported) off rank 0.
Their round trips through real MLflow and W&B are in tests/integration/trackers (test-trackers)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import pytest
import torch

from lite_core import LightningLite, MLflowLogger, TrackioLogger, WandbLogger
from lite_core.errors import MisuseError, MissingDependencyError
from lite_core.loggers._tracker import TrackerLogger, config_as_dict, flatten


@pytest.mark.parametrize(("logger", "module", "requirement"), [(WandbLogger, "wandb", "wandb>=0.17"),
                                                                (MLflowLogger, "mlflow", "mlflow>=2.10"),
                                                                (TrackioLogger, "trackio", "trackio>=0.43")])
def test_a_tracker_not_installed_is_named_with_its_pip_install(logger, module, requirement,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(MissingDependencyError) as info:
        logger()
    assert str(info.value) == (f"{logger.__name__} needs the {module} package, which is not installed: run"
                               f" `pip install '{requirement}'`.")  # lite-core[EXTRA]'s package: works today


@dataclasses.dataclass
class Config:
    lr: float = 0.1
    optimizer: dict = dataclasses.field(default_factory=lambda: {"name": "sgd", "momentum": 0.9})


def test_the_config_is_taken_as_a_dict_a_dataclass_or_a_namespace() -> None:
    expected = {"lr": 0.1, "optimizer": {"name": "sgd", "momentum": 0.9}}
    assert config_as_dict(expected) == expected
    assert config_as_dict(Config()) == expected
    assert config_as_dict(argparse.Namespace(**expected)) == expected
    assert flatten(expected) == {"lr": 0.1, "optimizer.name": "sgd", "optimizer.momentum": 0.9}
    with pytest.raises(MisuseError, match=r"^log_hyperparams takes a dict, a dataclass instance or an"
                                          r" argparse.Namespace, not a list: pass one of those.$"):
        config_as_dict([1, 2])


def test_steps_that_a_resume_repeats_are_skipped_but_one_step_may_be_logged_in_several_calls() -> None:
    logger = TrackerLogger()
    assert [logger._next_step(s) for s in (0, 1, 1, 2)] == [0, 1, 1, 2]
    state = logger.state_dict()
    assert state == {"run_id": None, "last_step": 2}
    resumed = TrackerLogger()
    resumed.load_state_dict({"run_id": "abc", "last_step": 2})
    assert resumed.run_id == "abc"
    assert [resumed._next_step(s) for s in (1, 2, 3, 3, None)] == [None, None, 3, 3, 4]


class _Recorded(TrackerLogger):
    """A tracker logger whose run records what it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self._log_to_run(metrics, step)

    def _open(self):
        return self

    def _close(self) -> None:
        pass

    def log(self, values: dict, step: int) -> None:
        self.sent.append((step, values))


def test_a_replica_group_restarted_off_the_logging_process_keeps_what_it_would_send_if_it_came_to_log() -> None:
    """Kept values travel in the saved state (`"unsent"`): a group saved while another logged, then
    restarted and found first at the next round, sends the steps since the round began."""
    moment = {"round": 3, "leads": False}
    standby = _Recorded()
    standby._follow(lambda: moment["leads"], lambda: moment["round"])
    standby._log_to_run({"loss": 0.5}, step=4)
    standby._log_to_run({"loss": 0.25}, step=5)
    assert standby.sent == [] and standby.state_dict() == {"run_id": None, "last_step": -1,
                                                           "unsent": {4: {"loss": 0.5}, 5: {"loss": 0.25}}}
    restarted = _Recorded()
    restarted._follow(lambda: moment["leads"], lambda: moment["round"])
    moment.update(round=0)  # the strategy's own state (its round) loads after the loggers'
    restarted.load_state_dict(standby.state_dict())
    moment.update(round=4)  # the first round the restarted group logs in: another group leads
    restarted._log_to_run({"loss": 0.125}, step=6)
    moment.update(round=5, leads=True)
    restarted._log_to_run({"loss": 0.0625}, step=7)
    assert restarted.sent == [(4, {"loss": 0.5}), (5, {"loss": 0.25}), (6, {"loss": 0.125}), (7, {"loss": 0.0625})]
    assert restarted.state_dict() == {"run_id": None, "last_step": 7}  # sent: not kept any more


def test_a_group_that_heals_past_steps_it_never_trained_sends_its_peers_values_of_them_when_it_logs() -> None:
    """DiLoCo: group 0 resumed behind a sync (its save of step 16 was cut off) and waits in its own
    sync while group 1, not logging, trains steps 17 to 19; at group 1's sync (20) group 0 heals
    past them and is the logging group. The heal carries group 1's kept values, so group 0 sends
    them before step 20."""
    moment = {"round": 4, "leads": 0}
    healed, peer = _Recorded(), _Recorded()
    for index, logger in enumerate((healed, peer)):
        logger._follow(lambda index=index: moment["leads"] == index, lambda: moment["round"])
    for step in (17, 18, 19):
        peer._log_to_run({"loss": step / 10}, step=step)
    healed._take_kept(peer._kept())  # the heal, inside the sync of round 5
    moment.update(round=5)
    peer._log_to_run({"loss": 2.0}, step=20)  # dropped with what it kept: another group leads round 5
    healed._log_to_run({"loss": 2.5}, step=20)
    assert healed.sent == [(17, {"loss": 1.7}), (18, {"loss": 1.8}), (19, {"loss": 1.9}), (20, {"loss": 2.5})]
    assert peer.sent == [] and "unsent" not in healed.state_dict()


def test_a_heal_keeps_the_values_a_group_logged_itself_for_a_step() -> None:
    own, peer = _Recorded(), _Recorded()
    for logger in (own, peer):
        logger._follow(lambda: False, lambda: 3)
    own._log_to_run({"loss": 1.0}, step=5)
    peer._log_to_run({"loss": 9.0}, step=5)
    peer._log_to_run({"loss": 8.0}, step=6)
    own._take_kept(peer._kept())
    assert own._kept() == {5: {"loss": 1.0}, 6: {"loss": 8.0}}


def test_lite_hands_the_tracker_loggers_kept_values_to_a_strategy_whose_groups_heal() -> None:
    """What a strategy sends in a heal (`carry_in_heals`) is every tracker logger's kept values, and
    what it receives goes back into them: a peer's kept steps end up in this process's logger."""
    from lite_core.plugins import SingleDeviceStrategy

    carried: dict[str, object] = {}

    class Healing(SingleDeviceStrategy):
        def is_logging_process(self) -> bool:
            return False

        def logging_round(self) -> int | None:
            return 2

        def carry_in_heals(self, name: str, state: object) -> None:
            carried[name] = state

    first, second = _Recorded(), _Recorded()
    lite = LightningLite(accelerator="cpu", strategy=Healing(), loggers=[first, second])
    lite.log("loss", torch.tensor(0.5), step=3)
    [state] = carried.values()
    assert state.state_dict() == {"kept": [{3: {"loss": 0.5}}, {3: {"loss": 0.5}}]}
    state.load_state_dict({"kept": [{4: {"loss": 0.25}}, {}]})  # a heal from a peer that kept step 4
    assert first._kept() == {3: {"loss": 0.5}, 4: {"loss": 0.25}} and second._kept() == {3: {"loss": 0.5}}


def test_under_a_strategy_whose_logging_never_moves_nothing_is_kept_off_the_logging_process() -> None:
    quiet = _Recorded()
    quiet._follow(lambda: False)  # no logging round: e.g. rank 1 under ddp
    quiet._log_to_run({"loss": 0.5}, step=0)
    assert quiet.sent == [] and quiet.state_dict() == {"run_id": None, "last_step": -1}


def test_loading_after_a_run_was_opened_is_refused_in_one_sentence() -> None:
    logger = TrackerLogger()
    logger._run_id = logger._opened_run_id = "new"
    with pytest.raises(MisuseError, match=r"^TrackerLogger already opened run 'new' before loading the checkpoint"
                                          r" of run 'old': call self.load\(...\) before the first log"):
        logger.load_state_dict({"run_id": "old", "last_step": 3})


CLIENTS = ("wandb", "mlflow", "trackio")


@pytest.mark.trackers  # test-trackers runs it, where the clients are installed
@pytest.mark.skipif(not all(m in sys.modules or __import__("importlib").util.find_spec(m) for m in CLIENTS),
                    reason="needs lite-core[wandb,mlflow,trackio] installed (constructing the loggers checks for them)")
def test_off_rank_zero_every_call_is_a_no_op_that_imports_no_client(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path))
    for module in CLIENTS:
        monkeypatch.delitem(sys.modules, module, raising=False)
    loggers = (WandbLogger(save_dir=tmp_path, mode="offline"), MLflowLogger(tracking_uri="http://127.0.0.1:9"),
               TrackioLogger())
    for logger in loggers:
        logger.log_hyperparams({"lr": 0.1})
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.log_artifact(__file__)
        logger.finalize()
        assert logger.run_id is None
    assert not any(module in sys.modules for module in CLIENTS)
    assert list(tmp_path.iterdir()) == []


def test_lite_passes_the_config_to_the_loggers_that_take_it() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.configs: list = []

        def log_metrics(self, metrics, step=None) -> None:
            pass

        def log_hyperparams(self, config) -> None:
            self.configs.append(config)

    class MetricsOnly:
        def log_metrics(self, metrics, step=None) -> None:
            pass

    recorder = Recorder()
    lite = LightningLite(accelerator="cpu", loggers=[recorder, MetricsOnly()])
    lite.log_hyperparams(Config())
    assert recorder.configs == [Config()]


def test_lite_gives_the_tracker_loggers_the_strategys_logging_round() -> None:
    """A strategy whose logging may move (lite-torchft's replica groups) says so by its round: off
    the logging process, `lite.log` then keeps the values for the round, as the logger's state shows."""
    from lite_core.plugins import SingleDeviceStrategy

    class Standby(SingleDeviceStrategy):  # another replica group logs in round 7
        def is_logging_process(self) -> bool:
            return False

        def logging_round(self) -> int | None:
            return 7

    logger = _Recorded()
    lite = LightningLite(accelerator="cpu", strategy=Standby(), loggers=[logger])
    lite.log("loss", torch.tensor(0.5), step=3)
    assert logger.sent == [] and logger.state_dict()["unsent"] == {3: {"loss": 0.5}}
