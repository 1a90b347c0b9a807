"""The model apart from how it is trained or distributed: building a causal LM from the recipe (build.py; a recipe's
own fields give the Llama of llama.py, which imports no transformers), cutting it into pipeline stages (stages.py),
what training it needs in memory (memory.py), the device it runs on (device.py), and what this machine gives on it
(probe.py). Used by the peer, the checks of `doctor` and `join`, and the bootstrap; it imports nothing of theirs."""
