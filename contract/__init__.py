"""Contract suite: checks of the engines canopyx talks to."""
