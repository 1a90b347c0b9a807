"""A run's data: corpora of any shape read as streams (corpus, corpus_formats), tokenized once into memory-mapped
token files (token_store, prepare), and the run's dataset as the swarm delivers it, content-addressed files that the
run owner shares and peers fetch and verify (dataset, share). Both the peer and the bootstrap use it; it imports
neither."""
