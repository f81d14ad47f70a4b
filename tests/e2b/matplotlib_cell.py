"""A cell both SDK checks run on an image with matplotlib: four figures whose data comes back as charts."""

import matplotlib.pyplot as plt

plt.plot([1, 2, 3], [2, 4, 8], label="growth")
plt.title("Line")
plt.xlabel("Day (d)")
plt.show()
plt.scatter([1, 2], [3, 4], label="samples")
plt.show()
plt.bar(["apples", "pears"], [3, 5], label="stock")
plt.show()
plt.pie([1, 3], labels=["left", "right"])
plt.show()
