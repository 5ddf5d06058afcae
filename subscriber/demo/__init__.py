"""``weftboard demo``: a complete small RL loop on one machine (``rl_loop``), its terminal
view and plot (``view``), and its command (``commands``). Not product code: nothing in
the product imports it."""
