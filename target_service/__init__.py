"""The target service: scores draft blocks with the large target model."""
