"""Everything but the network: the model, the algorithm, its runtimes, the model store, costs."""
