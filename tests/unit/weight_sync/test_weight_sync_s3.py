"""The whole weight-sync path against an S3 server (moto) on localhost, through s3fs."""

import socket

import pytest

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install 'moto[server]'")
pytest.importorskip("s3fs", reason="s3fs is not installed: pip install s3fs")
boto3 = pytest.importorskip("boto3", reason="boto3 (installed with moto) is missing")

from rl.weight_sync import ObjectStore, WeightPublisher, WeightSubscriber, WeightSyncChecksumError  # noqa: E402
from rl.weight_sync import manifest as mf  # noqa: E402
from tests.unit.weight_sync.test_weight_sync import FakeTraining, assert_bit_exact  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3(monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port())
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="weights")
    try:
        yield {"client_kwargs": {"endpoint_url": endpoint}}
    finally:
        server.stop()


def test_publish_and_fetch_through_s3(s3):
    store = ObjectStore("s3://weights/run1/sync", storage_options=s3, retry_base_seconds=0.01)
    assert not store.is_local
    pub = WeightPublisher(store, snapshot_interval=4, keep_snapshots=1, shard_bytes=4096, chunk_bytes=1024)
    follower = WeightSubscriber(store)
    train = FakeTraining()
    for v in range(10):
        train.step()
        stats = pub.publish(train.state_dict(), v)
        if v:
            assert 0 < stats.delta_bytes < stats.full_bytes
        assert_bit_exact(follower.fetch(), train.state_dict())
    assert follower.snapshots_fetched == 1
    # a worker that joins late: newest snapshot (8) + delta 9, in a separate store client
    late = WeightSubscriber(ObjectStore("s3://weights/run1/sync", storage_options=s3))
    assert late.latest_version() == 9
    assert_bit_exact(late.fetch(), train.state_dict())
    assert late.snapshots_fetched == 1
    listed = sorted(v for v in map(mf.parse_version_dir, store.list_dirs()) if v is not None)
    assert listed == [8, 9]   # garbage-collected below the newest snapshot

    # a corrupt object in the bucket is refused, naming it
    key = next(p for p in store.fs.find(store.path("v000000000009")) if p.endswith(".zst"))
    store.fs.pipe_file(key, b"garbage")
    with pytest.raises(WeightSyncChecksumError, match=key.rsplit("/", 1)[-1]):
        WeightSubscriber(ObjectStore("s3://weights/run1/sync", storage_options=s3), max_refetch=1).fetch()

    # a version whose manifest never arrived is invisible
    store.put("v000000000010/delta-deadbeef-00000.zst", b"partial upload")
    assert late.latest_version() == 9


def test_unreachable_s3_is_retried_then_reported():
    store = ObjectStore("s3://weights/x", storage_options={
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_free_port()}"}, "key": "k", "secret": "s",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}, max_retries=2,
        retry_base_seconds=0.01)
    with pytest.raises(Exception, match="failed 3 times"):
        store.put("a", b"x")
    assert store.retries == 2
