"""What is stored: the database (engines, models, migrations), blob storage and the durable
runtime flags."""
