"""Performance: measured stage costs, projected time between tokens, the width they pick."""
