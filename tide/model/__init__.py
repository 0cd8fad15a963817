"""Models as files: fetching targets (`assets`), tiny test targets, what TIDE needs to know about a
target (`target`), and writing files other processes read (`files`)."""
