"""The size-1 world and rank sharding (multi-rank behaviour is tested through torchrun in the integration tier)."""

from quant.dist import SINGLE, World, init_world


def test_shard_covers_every_item_once_in_order():
    items = list(range(11))
    for size in (1, 2, 3, 4, 11, 13):
        parts = [World(rank=r, size=size).shard(items) for r in range(size)]
        assert [x for p in parts for x in p] == items
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_single_process_world_is_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    w = init_world("cpu")
    assert w == SINGLE and w.is_writer and not w.distributed
    assert w.all_gather_object({"a": 1}) == [{"a": 1}]
    assert w.broadcast_object(3) == 3
