"""Flow control: bands, fair sharing (VTC) and the queue, pure and synchronous."""
