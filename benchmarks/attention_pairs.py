"""Attention pairs (query, key) an update's micro-batch computes, by way of packing (CPU only).

train.share_prompts attends each response in a tile as wide as the longest response of its
tile (pipeline/roles/shared_attention.py); packing whole rows computes every pair of each
packed row (pipeline/packing.py). This counts, for one micro-batch of --rows rows in groups
of --samples (one prompt a group) with geometric response lengths, the pairs each way
computes, at several numbers of response tiles, against the pairs needed (each row causal
on its own). Shapes only: no model, no GPU.

    python benchmarks/attention_pairs.py                  # the long-tail micro-batch
    python benchmarks/attention_pairs.py --mean 1e9 --max-response 256 --rows 88
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import geometric_lengths, padded_rows, share_prompts  # noqa: E402
from pipeline.packing import pack_rows, pack_shared_prompts  # noqa: E402
from pipeline.roles import shared_attention  # noqa: E402


def tile_pairs(tiles: shared_attention.PromptsThenResponses) -> int:
    prompts, width = tiles.prompts.real.shape
    return prompts * width * width + sum(k * length * (width + length)
                                         for k, length in (tile.real.shape for tile in tiles.responses))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--mean", type=float, default=215.0, help="geometric mean response length")
    parser.add_argument("--tiles", type=int, nargs="*", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    responses = geometric_lengths(args.rows, args.mean, args.max_response, seed=0)
    ids, mask = share_prompts(*padded_rows([args.prompt] * args.rows, responses, 1000, prompt_width=args.prompt,
                                           response_width=args.max_response, seed=0), args.prompt, args.samples)
    shared = pack_shared_prompts(ids, mask, args.prompt)
    print(f"{args.rows} rows in groups of {args.samples}, prompts {args.prompt}, responses mean "
          f"{sum(responses) / len(responses):.0f} (longest {max(responses)}): millions of attention pairs")
    for count in args.tiles:
        shared_attention.RESPONSE_TILES = count
        tiles = shared_attention.PromptsThenResponses.of(shared)
        print(f"  shared prompts, RESPONSE_TILES {count} ({len(tiles.responses)} made): {tile_pairs(tiles) / 1e6:.1f}")
    packed = pack_rows(ids, mask).input_ids.shape
    print(f"  whole rows packed ({packed[0]} rows of {packed[1]}): {packed[0] * packed[1] ** 2 / 1e6:.1f}")
    needed = sum((args.prompt + r) * (args.prompt + r + 1) // 2 for r in responses)
    print(f"  needed, each row causal on its own: {needed / 1e6:.1f}")


if __name__ == "__main__":
    main()
