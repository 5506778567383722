"""dstrain's data pipeline: text -> packed Megatron shards -> fixed-length training samples.

    corpus.py    the stdlib-documentation corpus (real text for demos and tests)
    sources.py   reading --dataset: Hub ids, save_to_disk folders, files, globs; input checks
    tokenizer.py loading / training tokenizers, their content hash, verify_tokenizer
    encode.py    parallel, memory-bounded tokenisation
    chat.py      --chat: conversations rendered by a chat template, and their loss mask (chat_corpus.py: the
                 demo's conversations, from the stdlib's documentation)
    shard_writing.py  writing shards from an encoder's output, resumably
    shards.py    Megatron MMIDIDX v1 writer and reader
    manifest.py  manifest.json of a prepared folder
    prepare.py   the work of `dstrain prepare` (resumable)
    prepare_parts.py  prepare as N tasks (a Slurm array): each task's part of the input, and the merge
    index.py     vectorised index builders + their cache (split, epochs, blend)
    dataset.py   build_dataset / collate: packed samples with document-aware position ids (chat_packing.py:
                 whole conversations per sample, and their loss mask)
    sampler.py   micro_batches: data-parallel sample assignment, resumable

Imports stay lazy here: worker processes import only what they use.
"""
