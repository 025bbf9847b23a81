"""kvrouter_client.blockhash against the repository's golden vectors (kvstate/blockhash/testdata)."""

from __future__ import annotations

import json
import os
import unittest

from kvrouter_client import ValidationError, blockhash, events, hash_prompt, pb
from kvrouter_client.validation import check_events
from kvserver import REPO_ROOT

VECTORS = os.path.join(REPO_ROOT, "kvstate", "blockhash", "testdata", "hash_vectors.json")


class VectorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        with open(VECTORS, encoding="utf-8") as f:
            cls.vectors = json.load(f)

    def test_raw_xxh3(self) -> None:
        raw = self.vectors["raw"]
        self.assertGreaterEqual(len(raw), 30)
        for v in raw:
            with self.subTest(v["name"]):
                got = blockhash._xxh3(bytes.fromhex(v["input_hex"]), seed=int(v["seed"]))
                self.assertEqual(got, int(v["xxh3_64"]))

    def test_cases(self) -> None:
        cases = self.vectors["cases"]
        self.assertGreaterEqual(len(cases), 20)
        for c in cases:
            with self.subTest(c["name"]):
                bs, tokens = c["block_size"], c["tokens"]
                want_local = [int(h) for h in c["local_hashes"]]
                want_seq = [int(h) for h in c["sequence_hashes"]]
                s = blockhash.salt(c["lora_name"], c["cache_namespace"])
                self.assertEqual(s, int(c["salt"]))
                self.assertEqual(blockhash.local_hashes(tokens, bs, s), want_local)
                # Block by block, as the publisher hashes, gives the same.
                per_block = [blockhash.local(tokens[i * bs : (i + 1) * bs], s) for i in range(len(want_local))]
                self.assertEqual(per_block, want_local)
                self.assertEqual(blockhash.sequence(want_local), want_seq)
                for i in range(1, len(want_seq)):
                    self.assertEqual(blockhash.chain(want_seq[i - 1], want_local[i]), want_seq[i])
                self.assertEqual(blockhash.prompt_hashes(tokens, bs, c["lora_name"], c["cache_namespace"]), want_seq)

    def test_publisher_hashing_matches(self) -> None:
        # What Publisher(hash_tokens=True) does to an event: the vectors' local hashes, token ids gone.
        for c in self.vectors["cases"]:
            bs, tokens = c["block_size"], c["tokens"]
            if not c["local_hashes"] or bs == 0:
                continue
            with self.subTest(c["name"]):
                n = len(c["local_hashes"])
                st = pb.worker.BlocksStored(
                    blocks=[pb.worker.StoredBlock(block_hash=i + 1, token_ids=tokens[i * bs : (i + 1) * bs]) for i in range(n)],
                    lora_name=c["lora_name"],
                    cache_namespace=c["cache_namespace"],
                )
                ev = pb.worker.KvEvent(storage_tier=pb.types.STORAGE_TIER_DEVICE, stored=st)
                blockhash._stored_hasher(bs)([ev])
                self.assertEqual([b.tokens_hash for b in ev.stored.blocks], [int(h) for h in c["local_hashes"]])
                self.assertTrue(all(b.HasField("tokens_hash") and len(b.token_ids) == 0 for b in ev.stored.blocks))

    def test_multimodal_ids(self) -> None:
        ids = self.vectors["multimodal_ids"]
        self.assertGreaterEqual(len(ids), 10)
        for v in ids:
            with self.subTest(v["identifier"]):
                self.assertEqual(blockhash.multimodal_hash(v["identifier"]), int(v["mm_hash"]))

    def test_multimodal_cases(self) -> None:
        cases = self.vectors["multimodal_cases"]
        self.assertGreaterEqual(len(cases), 10)
        carried = 0
        for c in cases:
            with self.subTest(c["name"]):
                bs, tokens = c["block_size"], c["tokens"]
                want_local = [int(h) for h in c["local_hashes"]]
                want_seq = [int(h) for h in c["sequence_hashes"]]
                # The objects in the order the file lists them: the order a caller sends them in.
                objects = [(int(o["hash"]), o["start"], o["end"]) for o in c["objects"]]
                s = blockhash.salt(c["lora_name"], c["cache_namespace"])
                self.assertEqual(s, int(c["salt"]))
                self.assertEqual(blockhash.local_hashes(tokens, bs, s, objects), want_local)
                self.assertEqual(blockhash.local_hashes(tokens, bs, s, reversed(objects)), want_local, "objects in any order")
                self.assertEqual(blockhash.sequence(want_local), want_seq)
                self.assertEqual(blockhash.prompt_hashes(tokens, bs, c["lora_name"], c["cache_namespace"], objects), want_seq)
                # Block by block, with the hashes each block carries, in either order.
                self.assertEqual(len(c["block_mm_hashes"]), len(want_local))
                for i, mm in enumerate(c["block_mm_hashes"]):
                    block = tokens[i * bs : (i + 1) * bs]
                    hashes = [int(h) for h in mm]
                    self.assertEqual(blockhash.local_multimodal(block, hashes, s), want_local[i], f"block {i}")
                    self.assertEqual(blockhash.local_multimodal(block, hashes[::-1], s), want_local[i], f"block {i}, hashes reversed")
                    if not hashes:
                        self.assertEqual(blockhash.local(block, s), want_local[i], f"block {i} carries nothing")
                    carried += bool(hashes)
        self.assertGreaterEqual(carried, 15, "blocks that carry multimodal hashes")

    def test_publisher_hashing_folds_mm_hashes(self) -> None:
        # What Publisher(hash_tokens=True) does to a block with mm_hashes (given unsorted): the
        # vectors' local hashes, token ids and mm_hashes gone.
        for c in self.vectors["multimodal_cases"]:
            bs, tokens = c["block_size"], c["tokens"]
            with self.subTest(c["name"]):
                n = len(c["local_hashes"])
                ev = events.stored(
                    [(i + 1, tokens[i * bs : (i + 1) * bs], [int(h) for h in reversed(c["block_mm_hashes"][i])]) for i in range(n)],
                    lora_name=c["lora_name"],
                    cache_namespace=c["cache_namespace"],
                )
                check_events([ev], bs)
                blockhash._stored_hasher(bs)([ev])
                self.assertEqual([b.tokens_hash for b in ev.stored.blocks], [int(h) for h in c["local_hashes"]])
                self.assertTrue(all(len(b.token_ids) == 0 and len(b.mm_hashes) == 0 for b in ev.stored.blocks))
                check_events([ev], bs)  # what is sent passes the router's checks

    def test_hash_prompt_matches_the_vectors(self) -> None:
        # hash_prompt() keys a RouteRequest of each case's prompt (its objects in the file's order)
        # as the vectors' local hashes; a prompt the router would refuse is refused, unchanged.
        hashed = 0
        for c in self.vectors["cases"] + self.vectors["multimodal_cases"]:
            with self.subTest(c["name"]):
                bs, tokens = c["block_size"], c["tokens"]
                req = pb.router.RouteRequest(
                    model="m", token_ids=tokens, lora_name=c["lora_name"], cache_namespace=c["cache_namespace"],
                    multimodal_objects=[pb.router.MultimodalObject(mm_hash=int(o["hash"]), start=o["start"], end=o["end"]) for o in c.get("objects", [])],
                )
                before = pb.router.RouteRequest()
                before.CopyFrom(req)
                refusal = None
                if bs == 0:
                    refusal = "block_size: must be at least 1 (got 0)"
                elif not tokens:
                    refusal = "token_ids: must not be empty"
                elif any(o["end"] <= o["start"] for o in c.get("objects", [])):
                    o = next(o for o in c["objects"] if o["end"] <= o["start"])
                    refusal = f"multimodal_objects[{c['objects'].index(o)}].end: must be greater than start {o['start']} (got {o['end']})"
                if refusal is not None:
                    with self.assertRaises(ValidationError) as cm:
                        hash_prompt(req, bs)
                    self.assertEqual(str(cm.exception), refusal)
                    self.assertEqual(req, before)
                    continue
                hash_prompt(req, bs)
                want = pb.router.RouteRequest(model="m", block_hashes=[int(h) for h in c["local_hashes"]], block_size=bs, prompt_tokens=len(tokens))
                self.assertEqual(req, want)
                hashed += 1
        self.assertGreaterEqual(hashed, 25, "cases hashed")

    def test_bad_input_raises_value_error(self) -> None:
        for bad in ([-1, 0, 0, 0], [1 << 32, 0, 0, 0], [1.5, 0, 0, 0]):
            with self.assertRaises(ValueError):
                blockhash.local(bad, blockhash.SEED)
            with self.assertRaises(ValueError):
                blockhash.local_hashes(bad, 4)
        for s in (-1, 1 << 64):
            with self.assertRaises(ValueError):
                blockhash.local([1, 2, 3, 4], s)
        with self.assertRaises(ValueError):
            blockhash.chain(1 << 64, 0)
        self.assertEqual(blockhash.local_hashes(list(range(10)), 0), [])
        self.assertEqual(blockhash.salt("", ""), blockhash.SEED)
        for bad_obj in ((-1, 0, 4), (1 << 64, 0, 4), (1, -1, 4), (1, 0, 1 << 32), (1, 0), "abc", (1.5, 0, 4)):
            with self.assertRaises(ValueError, msg=repr(bad_obj)):
                blockhash.local_hashes([1, 2, 3, 4], 4, blockhash.SEED, [bad_obj])  # type: ignore[list-item]
        with self.assertRaises(ValueError):
            blockhash.local_multimodal([1, 2, 3, 4], [1 << 64])
        self.assertEqual(blockhash.local_multimodal([1, 2, 3, 4], []), blockhash.local([1, 2, 3, 4]))
        # An object past the prompt's complete blocks, or empty, changes nothing.
        self.assertEqual(blockhash.local_hashes(list(range(10)), 4, blockhash.SEED, [(7, 8, 10), (7, 3, 3)]), blockhash.local_hashes(list(range(10)), 4))


class EventsTest(unittest.TestCase):
    def test_stored_takes_token_ids_or_tokens_hash(self) -> None:
        h = blockhash.local([1, 2, 3, 4])
        ev = events.stored([(7, [1, 2, 3, 4]), (8, h), (9, [5, 6, 7, 8], [3, 2])])
        a, b, c = ev.stored.blocks
        self.assertEqual((list(a.token_ids), a.HasField("tokens_hash"), list(a.mm_hashes)), ([1, 2, 3, 4], False, []))
        self.assertEqual((list(b.token_ids), b.tokens_hash), ([], h))
        self.assertEqual((list(c.token_ids), list(c.mm_hashes)), ([5, 6, 7, 8], [3, 2]))
        check_events([ev], 4)
        check_events([events.stored([(1, [1, 2, 3, 4], range(64))])], 4)  # 64 mm_hashes: at the limit


if __name__ == "__main__":
    unittest.main()
