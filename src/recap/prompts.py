"""Built-in prompts for `recap check`, `make demo` and the tests (no data files needed)."""

from __future__ import annotations

from collections.abc import Iterator

from PIL import Image

from recap.images import synthetic_image

TEXT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in two sentences.",
    "List five fruits that are red.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "Give me three tips for better sleep.",
    "What is 12 times 12?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "Name the planets of the solar system in order.",
    "What does a thermometer measure?",
    "Summarise the story of Cinderella in one paragraph.",
    "What are the primary colours?",
    "Suggest a name for a small bakery.",
    "How do bees make honey?",
    "What is the boiling point of water in Fahrenheit?",
    "Write a short thank-you note to a teacher.",
    "Explain what a prime number is.",
    "What is the difference between weather and climate?",
    "Give an example of a metaphor.",
    "How many days are there in a leap year?",
    "Describe the taste of lemonade.",
    "What should I pack for a day at the beach?",
    "Count from one to ten in words.",
    "What is the largest ocean on Earth?",
    "Write two sentences about the moon.",
    "Why do leaves change colour in the fall?",
    "What is an adjective? Give two examples.",
    "Tell me a fun fact about octopuses.",
    "How does a rainbow form?",
    "Repeat the word 'echo' five times.",
    "What is the opposite of 'ancient'?",
    "Describe a sunny day at the park.",
    "Which animals live in the Arctic?",
    "What is the square root of 81?",
    "Write a riddle about a clock.",
    "Explain gravity to a child.",
    "What are three uses of water at home?",
]

IMAGE_PROMPTS = [
    "Describe this image.",
    "What colours do you see in the picture?",
    "How many shapes are in the image?",
    "What is in the top left corner?",
    "Write a caption for this picture.",
    "Is the background light or dark?",
]

IMAGE_SIZES = [(64, 64), (100, 37), (300, 200), (17, 90), (224, 224), (640, 480), (33, 33), (512, 128)]


def check_prompts(count: int, *, images: bool) -> Iterator[tuple[str, Image.Image | None]]:
    """``count`` (prompt, image) pairs. With ``images``, three in four carry a seeded synthetic
    image of varied size; the rest are text-only."""
    for i in range(count):
        if images and i % 4 != 3:
            width, height = IMAGE_SIZES[i % len(IMAGE_SIZES)]
            yield IMAGE_PROMPTS[i % len(IMAGE_PROMPTS)], synthetic_image(i, width, height)
        else:
            yield TEXT_PROMPTS[i % len(TEXT_PROMPTS)], None
