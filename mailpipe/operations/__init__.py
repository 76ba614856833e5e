"""Running the fleet: the sweeper that turns the database back into work, the backlog metrics,
and the status an operator reads."""
