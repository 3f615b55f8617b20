"""Sharded weight publish (rl/weight_sync/publisher.py): a 4-rank fsdp x ep2 trainer publishes every rank's owned
boxes; readers of other layouts get bit-identical weights after every version, and rollout engines in tp2 and
ep2 (a WeightSubscriber of their boxes) hold them after every version, fetching only the chunks of their own
boxes; an owner failing mid-publish leaves the version invisible; a slow owner delays the version, not the
trainer's next step (publish_async) (workers/weight_sync_sharded_worker.py), through a local directory and
moto S3."""

import socket

import pytest

from rl.weight_sync import WeightSyncError
from rl.weight_sync.publisher import owned_boxes
from tests.distributed import torchrun  # noqa: E402


def test_each_box_is_owned_by_the_lowest_rank_holding_it():
    rows = [(("w", ((0, 2), (0, 4)))), (("w", ((2, 4), (0, 4))))]
    norm = ("n", ((0, 4),))
    held = [[rows[0], norm], [rows[1], norm], [rows[0], norm], [rows[1], norm]]   # two replicas of two shards
    owned = owned_boxes(held, {"w": [4, 4], "n": [4]})
    assert owned == [{rows[0], norm}, {rows[1]}, set(), set()]
    with pytest.raises(WeightSyncError, match="do not tile"):   # a gap
        owned_boxes([[rows[0]]], {"w": [4, 4]})
    with pytest.raises(WeightSyncError, match="do not tile"):   # a partial overlap
        owned_boxes([[("w", ((0, 3), (0, 4)))], [("w", ((1, 4), (0, 4)))], [rows[0]]], {"w": [4, 4]})


def _check(res):
    for case, r in res.items():
        assert r["ok"], f"{case}:\n{r.get('error')}"
    pr = res["publish_read"]
    assert pr["versions"] == [1, 2, 3, 4, 5]
    assert pr["owners"] == [4] * 5   # every trainer rank wrote objects of its own
    for key in ("full_equal", "follower_equal", "box_equal", "held_box_equal"):
        assert pr[key] == [True] * 5, key
    assert 0 < pr["fetched_fraction"][0] < 0.6   # expert rows of one rollout rank: their owners' objects only
    fault = res["owner_fault"]
    assert fault["failed_publish_raised"]
    assert fault["latest_after_failure"] == 2 and fault["failed_version_objects"] == 0
    assert fault["next_base"] == 2 and fault["follower_version"] == 4 and fault["follower_equal"]
    assert fault["follower_snapshots"] == 1   # version 4 applied as a delta on the held version 2
    ranks = res["engines"]["ranks"]
    assert [r["layout"] for r in ranks] == ["tp2", "tp2", "ep2", "ep2"]
    for r in ranks:   # every rollout rank, after every version, holds its slices of the trainer's weights
        assert r["equal"] == [True] * 5 and r["tokens_equal"] and r["weight_version"] == 5
        assert r["delta"] == [False, True, True, True, True]   # a snapshot, then XOR deltas on the held weights
        # it read exactly the chunks holding elements of its own boxes, fewer bytes than the version's
        assert r["bytes_read"] == r["own_chunk_bytes"]
        assert all(b < n for b, n in zip(r["bytes_read"], r["version_bytes"]))
        assert sum(r["ranged"]) > 0   # objects of which only some chunks are its own: ranged reads
    slow = res["slow_owner"]
    for key in ("first_sync", "returned_while_invisible", "stepped_while_invisible", "waited_for_previous", "flushed",
                "equal"):
        assert slow[key], key


def test_sharded_publish_fsdp_ep2_to_other_layouts_local_store(tmp_path):
    _check(torchrun.run_worker("weight_sync_sharded_worker.py", 4, [], tmp_path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e   # ~6 min on 2 busy cores: every object and range read is an HTTP request to the moto server
def test_sharded_publish_fsdp_ep2_to_other_layouts_s3(tmp_path, monkeypatch):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    boto3 = pytest.importorskip("boto3")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port())
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="weights")
        monkeypatch.setenv("WEIGHT_SYNC_S3_ENDPOINT", endpoint)
        _check(torchrun.run_worker("weight_sync_sharded_worker.py", 4, ["--store", "s3://weights/sharded"], tmp_path))
    finally:
        server.stop()
