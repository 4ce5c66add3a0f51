//! Level 2 (skeleton; being built).
