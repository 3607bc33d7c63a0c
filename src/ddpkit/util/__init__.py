"""The bottom layer every package may import: ddpkit's environment variables, atomic small
text files, the walk over nested batches and states."""
