"""Launchers for real engines used by the contract suite (llama.cpp, ...)."""
