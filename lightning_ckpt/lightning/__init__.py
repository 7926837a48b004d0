"""The PyTorch Lightning integration: the callback and what it drives. Lightning is imported only here."""
