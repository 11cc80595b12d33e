"""megatron_ext.logs: lines every rank would say alike come from the first rank; the bench's
--verbose prefixes each line with its rank."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from megatron_ext import logs


@pytest.fixture
def no_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env, level",
    [
        ({}, logging.INFO),  # a single process: it is the first rank
        ({"RANK": "0"}, logging.INFO),
        ({"RANK": "3"}, logging.DEBUG),
        ({"SLURM_PROCID": "0"}, logging.INFO),
        ({"SLURM_PROCID": "5"}, logging.DEBUG),
    ],
)
def test_once_per_job_before_the_process_group_reads_the_launchers_rank(no_process_group, env, level):
    for name, value in env.items():
        no_process_group.setenv(name, value)
    assert logs.once_per_job(logging.INFO) == level


def test_once_per_job_follows_torch_distributed_once_initialised(no_process_group):
    no_process_group.setenv("RANK", "0")  # the process group's rank wins over the environment
    no_process_group.setattr(dist, "is_initialized", lambda: True)
    no_process_group.setattr(dist, "get_rank", lambda group=None: 2)
    assert logs.once_per_job(logging.WARNING) == logging.DEBUG
    no_process_group.setattr(dist, "get_rank", lambda group=None: 0)
    assert logs.once_per_job(logging.WARNING) == logging.WARNING


def test_the_patch_says_it_once_per_job(no_process_group, caplog):
    import megatron_ext.patches

    caplog.set_level(logging.DEBUG, logger="megatron_ext")
    no_process_group.setenv("RANK", "1")
    applied = megatron_ext.patches.apply(training=False)
    megatron_ext.patches.revert(applied)
    said = [r for r in caplog.records if "Megatron-Core (" in r.getMessage()]
    assert len(said) == 2 and all(r.levelno == logging.DEBUG for r in said), [(r.levelno, r.getMessage()) for r in said]


def test_log_with_rank_prefix(capsys):
    package = logging.getLogger("megatron_ext")
    saved = package.handlers[:], package.level, package.propagate
    try:
        logs.log_with_rank_prefix(7)
        logging.getLogger("megatron_ext.dispatcher").info("calibrated")
        logging.getLogger("megatron_ext.dispatcher").debug("not shown")
    finally:
        package.handlers[:], package.level, package.propagate = saved
    assert capsys.readouterr().err == "[rank 7] INFO megatron_ext.dispatcher: calibrated\n"
