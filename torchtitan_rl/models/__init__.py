"""Model families; ``models.registry`` names them for the trainer."""
