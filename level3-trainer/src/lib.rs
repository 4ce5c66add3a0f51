//! Level 3 (skeleton; being built).
