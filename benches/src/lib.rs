//! Workload driver.
