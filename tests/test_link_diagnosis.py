"""A collective that failed because peers went silent, mapped to one line
naming them, without a cluster: which errors count, how a peer host is
probed, and what the line says. tests/test_cluster_link_cut.py proves it on
two emulated hosts."""

import contextlib
import socket

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from giantmodel import cli
from giantmodel.checkpoint.manager import CheckpointSaveError
from giantmodel.config import ConfigError
from giantmodel.config.errors import RunStopped
from giantmodel.distributed.init import (
    HostLostError,
    PeerHost,
    describe_silent_peers,
    is_collective_failure,
    probe_host,
    probe_peer_hosts,
)

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78]"
                " Timed out waiting 20000ms for recv operation to complete")
PEERS = [PeerHost(0, "host0", ("10.50.0.1",)), PeerHost(1, "host0", ("10.50.0.1",)),
         PeerHost(2, "host1", ("10.50.0.2",)), PeerHost(3, "host1", ("10.50.0.2",)),
         PeerHost(4, "host2", ("10.50.0.3",)), PeerHost(5, "host2", ("10.50.0.3",))]


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:  # noqa: BLE001 - the chain is what is tested
        return e


@contextlib.contextmanager
def _silent_port():
    """A local port that stays silent like a host behind a cut link: Linux
    drops a SYN whose listener's accept queue is full (backlog 0 holds one
    connection, taken here), so a connect there times out."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as srv:
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            yield port


def test_timeouts_and_closed_pairs_count_bad_input_does_not():
    assert is_collective_failure(RuntimeError(GLOO_TIMEOUT))
    assert is_collective_failure(RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Application timeout caused pair "
        "closure"))
    assert is_collective_failure(RuntimeError("Connection closed by peer [10.50.0.2]:4242"))
    # the checkpoint manager's one-line error carries the text of every rank's cause
    assert is_collective_failure(CheckpointSaveError(
        f"saving checkpoint step 8 failed (rank 0: RuntimeError: {GLOO_TIMEOUT})"))
    # DCP wraps each rank's failure; a cause further down the chain counts too
    assert is_collective_failure(CheckpointException("save", {1: (RuntimeError(GLOO_TIMEOUT), [])}))
    assert is_collective_failure(_chained(KeyError("x"), RuntimeError(GLOO_TIMEOUT)))
    dist_error = type("DistBackendError", (RuntimeError,), {})
    assert is_collective_failure(dist_error("NCCL watchdog"))

    assert not is_collective_failure(RuntimeError("shape mismatch in all_reduce"))
    assert not is_collective_failure(ValueError("timed out reading the config"))
    assert not is_collective_failure(ConfigError("must be > 0", "parallel.timeout_s"))


def test_probe_tells_a_live_process_a_dead_one_and_a_silent_host_apart():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert probe_host(PeerHost(1, "h", ("127.0.0.1",), port), 1.0) == "answers"
    # the listener closed: the host refuses the rank's port, so its process is gone
    assert probe_host(PeerHost(1, "h", ("127.0.0.1",), port), 1.0) == "process gone"
    with _silent_port() as port:
        assert probe_host(PeerHost(1, "h", ("127.0.0.1",), port), 0.3) == \
            "no answer within 0.3 s"
    assert probe_host(PeerHost(1, "h", ()), 0.3) == "no address known"


def test_each_other_host_is_probed_once():
    with socket.create_server(("127.0.0.1", 0)) as listener, _silent_port() as silent:
        port = listener.getsockname()[1]
        peers = [PeerHost(0, "a", ("127.0.0.1",), port), PeerHost(1, "b", ("127.0.0.1",), port),
                 PeerHost(2, "b", ("127.0.0.1",), silent), PeerHost(3, "c", ("127.0.0.1",), silent)]
        verdicts = probe_peer_hosts(peers, me=0, timeout_s=0.3)
    # not our own host; b by its first rank
    assert verdicts == {"b": "answers", "c": "no answer within 0.3 s"}


def test_the_line_names_silent_hosts_their_ranks_and_where_each_was():
    verdicts = {"host1": "no answer within 3 s", "host2": "answers"}
    line = describe_silent_peers(RuntimeError(GLOO_TIMEOUT), PEERS, 0, verdicts,
                                 {2: "step 6 forward_backward", 3: "step 6 forward_backward",
                                  4: "step 7 forward_backward"},
                                 "step 6 forward_backward (group 0 #130 gloo:all_reduce)")
    assert line == ("lost contact with host host1 (ranks [2, 3], 10.50.0.2): no answer within "
                    "3 s; newest reached: host1 step 6 forward_backward; rank 0 on host0 waited "
                    "in step 6 forward_backward (group 0 #130 gloo:all_reduce): Timed out waiting "
                    "20000ms for recv operation to complete")
    two = describe_silent_peers(
        CheckpointSaveError(f"saving failed (rank 0: RuntimeError: {GLOO_TIMEOUT})"), PEERS, 1,
        {"host1": "no route to host", "host2": "process gone"})
    assert two.startswith("lost contact with hosts host1 (ranks [2, 3], 10.50.0.2): no route to "
                          "host; host2 (ranks [4, 5], 10.50.0.3): process gone; newest reached: "
                          "host1 not known from here, host2 not known from here; rank 1 on "
                          "host0 waited in a collective: saving failed")
    assert "\n" not in two
    # every host answers: the peers are alive, the cause is elsewhere (a hang)
    assert describe_silent_peers(RuntimeError(GLOO_TIMEOUT), PEERS, 0,
                                 {"host1": "answers", "host2": "answers"}) is None


def test_a_lost_host_ends_the_cli_on_its_line_without_a_traceback(monkeypatch, capsys):
    line = "lost contact with host host1 (ranks [2, 3], 10.50.0.2): no answer within 3 s"
    assert issubclass(HostLostError, RunStopped)

    def lose(cfg):
        raise HostLostError(line) from RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(cli, "run_training", lose)
    assert cli.main(["train", "train.steps=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {line}"
    assert not any("Traceback" in x for x in err)


@pytest.mark.parametrize("text", ["Timed out waiting 5000ms for send operation to complete",
                                  "Connection reset by peer", "No route to host"])
def test_transport_texts_count(text):
    assert is_collective_failure(RuntimeError(text))
