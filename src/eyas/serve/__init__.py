"""Drivers of real serving engines (vLLM): serving a drafter, generating answers and capturing
hidden states with the engine the user deploys on, instead of eyas's own runtime.

Nothing here reimplements the engine: tensor/pipeline parallelism and scheduling are vLLM's.
`formats.engines` is the other side of the same contract: what each engine reads from a drafter
directory, pinned from its source; the modules here run the engine itself.
"""
