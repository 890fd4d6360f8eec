"""Performance: measured stage costs, projected time between tokens, and the tree width chosen from them."""
