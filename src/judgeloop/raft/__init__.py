"""RAFT data: readers that turn QA sets into questions with oracle documents, token chunking, the
builder (distractors, oracle rate, quoted reasoning, leak-free splits) and its SFT / evaluation inputs.

It sits above :mod:`judgeloop.retrieval` (the hard-distractor source mines with a bi-encoder) and
:mod:`judgeloop.models` (LM-written reasoning); :mod:`judgeloop.data` stays below both.
"""

from judgeloop.raft.builder import BuildRaftConfig, build_raft, save_raft
from judgeloop.raft.chunking import ChunkConfig, chunk_text
from judgeloop.raft.readers import RaftDoc, RaftQuestion, ReadResult

__all__ = [
    "BuildRaftConfig",
    "ChunkConfig",
    "RaftDoc",
    "RaftQuestion",
    "ReadResult",
    "build_raft",
    "chunk_text",
    "save_raft",
]
