"""Key-value tensor stores: in-process (tests, demo) and TransferQueue."""
