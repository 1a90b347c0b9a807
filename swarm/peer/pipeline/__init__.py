"""Pipelines of peers (SWARM parallelism) in a run cut into stages: which part of the model a peer trains and how
(part.py), one stage's computation (worker.py), hops to the next stage's peers (routing.py), serving a stage to the
stage before (server.py), a first stage's stream of microbatches (microbatches.py), and where a peer moves when the
stages are out of balance (placement.py)."""
