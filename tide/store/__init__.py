"""Hidden-state store: write-once HDF5 chunk files of captured EAGLE-3 hidden states.

Writers (`ChunkWriter`, on the serving side) never block the engine; readers (`ChunkReader`, on
the trainer side) verify every file and skip bad ones. See `chunk.py` for the file schema.
"""

from tide.store.chunk import (
                              FORMAT_VERSION,
                              ChunkError,
                              ChunkMeta,
                              Run,
                              bf16_to_u16,
                              chunk_name,
                              read_chunk,
                              read_header,
                              u16_to_bf16,
                              write_chunk,
)
from tide.store.reader import ChunkReader, is_eval
from tide.store.writer import ChunkWriter

__all__ = [
    "FORMAT_VERSION", "ChunkError", "ChunkMeta", "ChunkReader", "ChunkWriter", "Run", "bf16_to_u16",
    "chunk_name", "is_eval", "read_chunk", "read_header", "u16_to_bf16", "write_chunk",
]
