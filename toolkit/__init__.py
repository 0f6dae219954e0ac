"""toolkit: launch and keep alive data-parallel training across many hosts over SSH."""
